// CPU kernels of the grid lookup grid_interpolate (a channels-last (R0, R1, R2, C) grid at (N, 3) points),
// forward and backward. float32/float64, 64-bit indexing, at::parallel_for over points.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "grid_interpolate.h"
#include "grid_reorder.h"
#include "ops.h"

namespace cuda_ext {
namespace {

// A point's 8 voxels, located once per point for the loops over channels: their element offsets and
// their weights (from corner_weights).
template <typename scalar_t>
GridCorners<scalar_t> locate(const scalar_t* point, const GridShape& s, int64_t offset[8], scalar_t weight[8]) {
  const GridCorners<scalar_t> c = locate_corners(point[0], point[1], point[2], s);
  for (int k = 0; k < 8; ++k) offset[k] = c.offset(k);
  corner_weights(c.t[0], c.t[1], c.t[2], weight);
  return c;
}

template <typename scalar_t>
void grid_forward(const scalar_t* grid, const scalar_t* points, scalar_t* out, int64_t n_points, GridShape s) {
  const int64_t ch = s.channels;
  at::parallel_for(0, n_points, grain_for(9 * ch), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t offset[8];
      scalar_t weight[8];
      locate(points + 3 * n, s, offset, weight);
      scalar_t* o = out + n * ch;
      for (int64_t j = 0; j < ch; ++j) {
        scalar_t acc = 0;
        for (int k = 0; k < 8; ++k) acc += weight[k] * grid[offset[k] + j];
        o[j] = acc;
      }
    }
  });
}

template <typename scalar_t>
void grid_point_grads_cpu(const scalar_t* grad_out, const scalar_t* grid, const scalar_t* points, scalar_t* grad_points,
                          int64_t n_points, GridShape s) {
  const int64_t ch = s.channels;
  at::parallel_for(0, n_points, grain_for(9 * ch), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t offset[8];
      scalar_t weight[8];  // unused here
      const GridCorners<scalar_t> c = locate(points + 3 * n, s, offset, weight);
      const scalar_t* g = grad_out + n * ch;
      scalar_t dots[8];
      for (int k = 0; k < 8; ++k) {
        scalar_t acc = 0;
        for (int64_t j = 0; j < ch; ++j) acc += g[j] * grid[offset[k] + j];
        dots[k] = acc;
      }
      scalar_t grad[3];
      grid_point_grads(c, dots, grad);
      for (int a = 0; a < 3; ++a) grad_points[3 * n + a] = grad[a];
    }
  });
}

// Scatter-add of grad_out into grad_grid (zero-initialised) without atomics or private copies.
// Points are bucketed by their low axis-0 index lo0 (a counting sort; buckets are contiguous
// ranges of lo0). Pass 0 adds the 4 corners at i0 = lo0, pass 1 the 4 at i0 = hi0 = lo0 + 1.
// Within one pass a bucket writes only its own axis-0 slabs ([start, end) in pass 0,
// [start + 1, end] in pass 1), which no other bucket touches in that pass, so buckets run in
// parallel; the two passes run one after the other.
template <typename scalar_t>
void grid_scatter_cpu(const scalar_t* grad_out, const scalar_t* points, scalar_t* grad_grid, int64_t n_points,
                      GridShape s) {
  const int64_t ch = s.channels;
  const int64_t lo_values = std::max<int64_t>(s.r0 - 1, 1);  // lo0 lies in [0, lo_values)
  const int64_t n_buckets = std::min<int64_t>(lo_values, 4 * at::get_num_threads());
  std::vector<int64_t> bucket_of(n_points);
  at::parallel_for(0, n_points, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t lo0 = sample_axis(points[3 * n], s.r0).lo;
      bucket_of[n] = lo0 * n_buckets / lo_values;  // monotone in lo0: buckets are lo0 ranges
    }
  });
  std::vector<int64_t> bucket_start(n_buckets + 1, 0);
  for (int64_t n = 0; n < n_points; ++n) ++bucket_start[bucket_of[n] + 1];
  for (int64_t b = 0; b < n_buckets; ++b) bucket_start[b + 1] += bucket_start[b];
  std::vector<int64_t> order(n_points);
  {
    std::vector<int64_t> fill(bucket_start.begin(), bucket_start.end() - 1);
    for (int64_t n = 0; n < n_points; ++n) order[fill[bucket_of[n]]++] = n;
  }
  for (int pass = 0; pass < 2; ++pass) {
    at::parallel_for(0, n_buckets, 1, [&](int64_t b_begin, int64_t b_end) {
      for (int64_t i = bucket_start[b_begin]; i < bucket_start[b_end]; ++i) {
        const int64_t n = order[i];
        int64_t offset[8];
        scalar_t weight[8];
        locate(points + 3 * n, s, offset, weight);
        const scalar_t* g = grad_out + n * ch;
        for (int k = 4 * pass; k < 4 * pass + 4; ++k) {  // corners 0-3 have i0 = lo0, 4-7 have i0 = hi0
          scalar_t* dst = grad_grid + offset[k];
          const scalar_t w = weight[k];
          for (int64_t j = 0; j < ch; ++j) dst[j] += w * g[j];
        }
      }
    });
  }
}

}  // namespace

// ------------------------------------------------------------------------------ entry points

at::Tensor grid_interpolate_cpu(const at::Tensor& grid_in, const at::Tensor& points_in) {
  check_grid_inputs(grid_in, points_in, at::kCPU, "grid_interpolate");
  reorder_mode("grid_interpolate");  // validated on both backends; the CPU kernel visits points as given
  const at::Tensor grid = grid_in.contiguous(), points = points_in.contiguous();
  const int64_t n = points.size(0);
  at::Tensor out = at::empty({n, grid.size(3)}, grid.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(grid.scalar_type(), "grid_interpolate_cpu", [&] {
    grid_forward(grid.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, grid_shape(grid));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> grid_interpolate_backward_cpu(const at::Tensor& grad_out_in,
                                                                 const at::Tensor& grid_in, const at::Tensor& points_in,
                                                                 bool grid_requires_grad, bool points_requires_grad,
                                                                 const std::optional<at::Tensor>& grad_into) {
  const char* op = "grid_interpolate_backward";
  check_grid_inputs(grid_in, points_in, at::kCPU, op);
  const int64_t n = points_in.size(0);
  check_grad_out(grad_out_in, n, grid_in.size(3), grid_in, "grid", op);
  const at::Tensor grad_out = grad_out_in.contiguous(), grid = grid_in.contiguous(), points = points_in.contiguous();
  at::Tensor grad_grid = lookup_grad_target(grid, grad_into, grid_requires_grad, "grid", op);  // float32/64: adds in T
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  const auto outputs = [&] { return std::make_tuple(grad_into ? no_grad_placeholder(grid) : grad_grid, grad_points); };
  if (grad_out.numel() == 0) return outputs();
  AT_DISPATCH_FLOATING_TYPES(grid.scalar_type(), "grid_interpolate_backward_cpu", [&] {
    const GridShape s = grid_shape(grid);
    if (grid_requires_grad) {
      grid_scatter_cpu(grad_out.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(), grad_grid.data_ptr<scalar_t>(), n,
                       s);
    }
    if (points_requires_grad) {
      grid_point_grads_cpu(grad_out.data_ptr<scalar_t>(), grid.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(),
                           grad_points.data_ptr<scalar_t>(), n, s);
    }
  });
  return outputs();
}

}  // namespace cuda_ext
