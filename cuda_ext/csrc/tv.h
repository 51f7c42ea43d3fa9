// sampled_tv: the total-variation estimate on sampled cells of a stack of dense vertex grids, its value returned
// and its gradient added into a gradient array in place. Argument checks, the cell layout and the per-cell math,
// shared by the CPU kernel (cpu/tv.cpp) and the CUDA kernel (cuda/tv.cu).
//
// A grid is G x (R0, R1, R2) vertices of C channels, rows flattened in that order: values (G * R0 * R1 * R2, C).
// A sampled cell is an int64 in [0, G * (R0-1) * (R1-1) * (R2-1)): its lower corner v and the three pairs
// (v, v + e_a). Each pair has weight 1, or `outside` when either end lies outside the foreground box (inclusive
// per-axis vertex ranges; no box: every pair weighs 1). The estimate is
//     scale / (S * C) * sum over cells s, axes a, channels c of  w_sa * (x[v_s + e_a, c] - x[v_s, c])^2
// (the mean over the S sampled cells and C channels of each axis' squared difference, summed over the axes),
// and its gradient, 2 * scale / (S * C) * w_sa * (difference), lands on the pair's far end and, negated, on v.
#pragma once

#include <cmath>

#include "kernel_common.h"

namespace cuda_ext {

struct TvLayout {
  int64_t r0, r1, r2;    // vertices per axis of one grid
  int64_t lo[3], hi[3];  // the foreground box's vertex range per axis, inclusive (weighted only)
  bool weighted;         // false: every pair weighs 1
  double outside;        // a pair's weight with an end outside the box
  int64_t cells;         // G * (R0-1) * (R1-1) * (R2-1): the cells a sample may name

  // The row of cell `cell`'s lower corner, and the pairs' three weights.
  CUDA_EXT_HOST_DEVICE int64_t corner(int64_t cell, double weight[3]) const {
    const int64_t c1 = r1 - 1, c2 = r2 - 1, per_grid = (r0 - 1) * c1 * c2;
    const int64_t g = cell / per_grid, rest = cell - g * per_grid;
    const int64_t v[3] = {rest / (c1 * c2), (rest / c2) % c1, rest % c2};
    for (int a = 0; a < 3; ++a) weight[a] = 1.0;
    if (weighted) {
      bool in[3], next_in[3];
      for (int a = 0; a < 3; ++a) {
        in[a] = lo[a] <= v[a] && v[a] <= hi[a];
        next_in[a] = lo[a] <= v[a] + 1 && v[a] + 1 <= hi[a];
      }
      for (int a = 0; a < 3; ++a) {
        const bool both = in[a] && next_in[a] && in[(a + 1) % 3] && in[(a + 2) % 3];
        weight[a] = both ? 1.0 : outside;
      }
    }
    return ((g * r0 + v[0]) * r1 + v[1]) * r2 + v[2];
  }

  // Row offsets of the +1 neighbours along axes 0, 1, 2.
  CUDA_EXT_HOST_DEVICE int64_t stride(int a) const { return a == 0 ? r1 * r2 : (a == 1 ? r2 : 1); }
};

// One channel of one sampled cell: x0 the corner's value, next[a] its +1 neighbour's along axis a. Returns the
// weighted squared differences' sum (unscaled) and writes the neighbours' gradients g[a] = two_k * w_a * d_a
// (the corner's is minus their sum); acc_t is the arithmetic type (float for float32, double for float64).
template <typename acc_t>
CUDA_EXT_HOST_DEVICE acc_t tv_channel(acc_t x0, const acc_t next[3], const double weight[3], acc_t two_k, acc_t g[3]) {
  acc_t sum = 0;
  for (int a = 0; a < 3; ++a) {
    const acc_t d = next[a] - x0, wd = static_cast<acc_t>(weight[a]) * d;
    sum += wd * d;
    g[a] = two_k * wd;
  }
  return sum;
}

// The backstop for direct torch.ops.cuda_ext calls (the Python wrapper checks the same, with the same words).
// cells' values are not read here: the CPU kernel checks their range as it goes, the CUDA kernel skips cells out
// of range (the wrapper rejects them before the launch unless told they are in range).
inline TvLayout check_sampled_tv_inputs(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& cells,
                                        at::IntArrayRef shape, at::IntArrayRef inside, double outside, double scale,
                                        at::DeviceType device) {
  const char* op = "sampled_tv";
  TORCH_CHECK(values.dim() == 2, op, ": values must have shape (G * R0 * R1 * R2, C), got ", values.sizes());
  check_device_type(values, "values", device, op);
  TORCH_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble, op,
              ": values must be float32 or float64, got ", values.scalar_type());
  TORCH_CHECK(values.is_contiguous(), op, ": values must be contiguous");
  TORCH_CHECK(grad.sizes() == values.sizes(), op, ": grad must have the shape of values ", values.sizes(), ", got ",
              grad.sizes());
  check_same_device_and_dtype(grad, values, op, "grad", "values");
  TORCH_CHECK(grad.is_contiguous(), op, ": grad must be contiguous (it is added to in place)");
  TORCH_CHECK(cells.dim() == 1, op, ": cells must have shape (S,), got ", cells.sizes());
  TORCH_CHECK(cells.scalar_type() == at::kLong, op, ": cells must be int64, got ", cells.scalar_type());
  TORCH_CHECK(cells.device() == values.device(), op, ": cells and values must be on the same device, got ",
              cells.device(), " and ", values.device());
  TORCH_CHECK(cells.is_contiguous(), op, ": cells must be contiguous");
  TORCH_CHECK(shape.size() == 3, op, ": shape must be [R0, R1, R2], got ", shape);
  for (const int64_t r : shape) TORCH_CHECK(r >= 2, op, ": shape must be at least 2 per axis, got ", shape);
  const int64_t per_grid_rows = shape[0] * shape[1] * shape[2];
  TORCH_CHECK(values.size(0) % per_grid_rows == 0, op, ": values' rows (", values.size(0),
              ") must be a whole number of grids of shape ", shape);
  TORCH_CHECK(inside.empty() || inside.size() == 6, op, ": inside must be [] or [lo0, hi0, lo1, hi1, lo2, hi2], got ",
              inside);
  TORCH_CHECK(std::isfinite(outside) && outside >= 0, op, ": outside must be a number >= 0, got ", outside);
  TORCH_CHECK(std::isfinite(scale), op, ": scale must be a finite number, got ", scale);
  TvLayout layout{shape[0], shape[1], shape[2], {0, 0, 0}, {0, 0, 0}, !inside.empty(), outside, 0};
  for (int a = 0; a < 3 && layout.weighted; ++a) {
    layout.lo[a] = inside[2 * a];
    layout.hi[a] = inside[2 * a + 1];
  }
  layout.cells = values.size(0) / per_grid_rows * (shape[0] - 1) * (shape[1] - 1) * (shape[2] - 1);
  return layout;
}

}  // namespace cuda_ext
