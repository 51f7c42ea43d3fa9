// CPU kernels of the sparse brick-grid lookup brick_grid_interpolate (values (M, C) rows found through an
// int32 brick table, at (N, 3) points), forward and backward. float32/float64, 64-bit indexing,
// at::parallel_for over points. Geometry and validation: ../brick_grid.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "brick_grid.h"
#include "ops.h"

namespace cuda_ext {
namespace {

// A point's 8 corners, located once per point for the loops over channels: where each corner's C values
// start (an empty brick's corner points at a row of zeros, so the blend is the dense lookup's, NaN weights
// included) and their weights (from corner_weights, as the dense CPU kernels).
template <typename scalar_t>
BrickCorners<scalar_t> locate(const scalar_t* point, const scalar_t* values, const int32_t* table,
                              const scalar_t* zero_row, const BrickShape& s, const scalar_t* corner[8],
                              scalar_t weight[8]) {
  const BrickCorners<scalar_t> c = locate_brick_corners(point[0], point[1], point[2], s);
  for (int k = 0; k < 8; ++k) {
    const int64_t row = c.row(k, table, s);
    corner[k] = row >= 0 ? values + row * s.channels : zero_row;
  }
  corner_weights(c.t[0], c.t[1], c.t[2], weight);
  return c;
}

template <typename scalar_t>
void brick_forward(const scalar_t* values, const int32_t* table, const scalar_t* points, scalar_t* out,
                   int64_t n_points, const BrickShape& s) {
  const int64_t ch = s.channels;
  const std::vector<scalar_t> zero_row(ch, scalar_t(0));
  at::parallel_for(0, n_points, grain_for(9 * ch), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* corner[8];
      scalar_t weight[8];
      locate(points + 3 * n, values, table, zero_row.data(), s, corner, weight);
      scalar_t* o = out + n * ch;
      for (int64_t j = 0; j < ch; ++j) {
        scalar_t acc = 0;
        for (int k = 0; k < 8; ++k) acc += weight[k] * corner[k][j];
        o[j] = acc;
      }
    }
  });
}

template <typename scalar_t>
void brick_point_grads_cpu(const scalar_t* grad_out, const scalar_t* values, const int32_t* table,
                           const scalar_t* points, scalar_t* grad_points, int64_t n_points, const BrickShape& s) {
  const int64_t ch = s.channels;
  const std::vector<scalar_t> zero_row(ch, scalar_t(0));
  at::parallel_for(0, n_points, grain_for(9 * ch), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* corner[8];
      scalar_t weight[8];  // unused here
      const BrickCorners<scalar_t> c = locate(points + 3 * n, values, table, zero_row.data(), s, corner, weight);
      const scalar_t* g = grad_out + n * ch;
      scalar_t dots[8];
      for (int k = 0; k < 8; ++k) {
        scalar_t acc = 0;
        for (int64_t j = 0; j < ch; ++j) acc += g[j] * corner[k][j];
        dots[k] = acc;
      }
      scalar_t grad[3];
      grid_point_grads(c, dots, grad);
      for (int a = 0; a < 3; ++a) grad_points[3 * n + a] = grad[a];
    }
  });
}

// Scatter-add of w_k * grad_out into grad_values (zero-initialised) without atomics or private copies: the
// (point, corner) pairs that read a row are counting-sorted into buckets of consecutive pool slots, and the
// buckets, which write disjoint rows, run in parallel. Bucketing by the row written (not by the corner's
// position, as grid_scatter_cpu does) keeps a table that maps two bricks to one slot race-free too. Within
// a bucket the pairs keep their order, so every row sums its terms in point order: the result does not
// depend on the thread count.
template <typename scalar_t>
void brick_scatter_cpu(const scalar_t* grad_out, const int32_t* table, const scalar_t* points, scalar_t* grad_values,
                       int64_t n_points, const BrickShape& s) {
  if (s.slots == 0) return;  // no bricks: every corner is empty
  const int64_t ch = s.channels;
  const int64_t n_buckets = std::min<int64_t>(s.slots, 4 * at::get_num_threads());
  // Pair e = 8 n + k adds weights[e] * grad_out[n] to row rows[e], which lies in bucket[e] (-1: an empty
  // corner, which adds nothing). Buckets are ranges of slots (monotone in the slot).
  std::vector<int64_t> rows(8 * n_points);
  std::vector<scalar_t> weights(8 * n_points);
  std::vector<int32_t> bucket(8 * n_points);
  at::parallel_for(0, n_points, grain_for(16), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const BrickCorners<scalar_t> c = locate_brick_corners(points[3 * n], points[3 * n + 1], points[3 * n + 2], s);
      corner_weights(c.t[0], c.t[1], c.t[2], &weights[8 * n]);
      for (int k = 0; k < 8; ++k) {
        const int64_t row = c.row(k, table, s);
        rows[8 * n + k] = row;
        bucket[8 * n + k] = row >= 0 ? static_cast<int32_t>(row / s.brick_rows * n_buckets / s.slots) : -1;
      }
    }
  });
  std::vector<int64_t> bucket_start(n_buckets + 1, 0);
  for (const int32_t b : bucket) {
    if (b >= 0) ++bucket_start[b + 1];
  }
  for (int64_t b = 0; b < n_buckets; ++b) bucket_start[b + 1] += bucket_start[b];
  std::vector<int64_t> order(bucket_start[n_buckets]);
  {
    std::vector<int64_t> fill(bucket_start.begin(), bucket_start.end() - 1);
    for (int64_t e = 0; e < 8 * n_points; ++e) {
      if (bucket[e] >= 0) order[fill[bucket[e]]++] = e;
    }
  }
  at::parallel_for(0, n_buckets, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t i = bucket_start[b_begin]; i < bucket_start[b_end]; ++i) {
      const int64_t e = order[i];
      const scalar_t w = weights[e];
      const scalar_t* g = grad_out + e / 8 * ch;
      scalar_t* dst = grad_values + rows[e] * ch;
      for (int64_t j = 0; j < ch; ++j) dst[j] += w * g[j];
    }
  });
}

}  // namespace

// ------------------------------------------------------------------------------ entry points

at::Tensor brick_grid_interpolate_cpu(const at::Tensor& values_in, const at::Tensor& table_in,
                                      const at::Tensor& points_in, at::IntArrayRef shape, int64_t brick) {
  check_brick_grid_inputs(values_in, table_in, points_in, shape, brick, at::kCPU, "brick_grid_interpolate");
  const at::Tensor values = values_in.contiguous(), table = table_in.contiguous(), points = points_in.contiguous();
  const int64_t n = points.size(0);
  at::Tensor out = at::empty({n, values.size(1)}, values.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "brick_grid_interpolate_cpu", [&] {
    brick_forward(values.data_ptr<scalar_t>(), table.data_ptr<int32_t>(), points.data_ptr<scalar_t>(),
                  out.data_ptr<scalar_t>(), n, brick_shape(values, table, shape, brick));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> brick_grid_interpolate_backward_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& values_in, const at::Tensor& table_in, const at::Tensor& points_in,
    at::IntArrayRef shape, int64_t brick, bool values_requires_grad, bool points_requires_grad,
    const std::optional<at::Tensor>& grad_into) {
  const char* op = "brick_grid_interpolate_backward";
  check_brick_grid_inputs(values_in, table_in, points_in, shape, brick, at::kCPU, op);
  const int64_t n = points_in.size(0);
  check_grad_out(grad_out_in, n, values_in.size(1), values_in, "values", op);
  const at::Tensor grad_out = grad_out_in.contiguous(), values = values_in.contiguous(), table = table_in.contiguous(),
                   points = points_in.contiguous();
  at::Tensor grad_values = lookup_grad_target(values, grad_into, values_requires_grad, "values", op);
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  const auto outputs = [&] {
    return std::make_tuple(grad_into ? no_grad_placeholder(values) : grad_values, grad_points);
  };
  if (grad_out.numel() == 0) return outputs();
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "brick_grid_interpolate_backward_cpu", [&] {
    const BrickShape s = brick_shape(values, table, shape, brick);
    if (values_requires_grad) {
      brick_scatter_cpu(grad_out.data_ptr<scalar_t>(), table.data_ptr<int32_t>(), points.data_ptr<scalar_t>(),
                        grad_values.data_ptr<scalar_t>(), n, s);
    }
    if (points_requires_grad) {
      brick_point_grads_cpu(grad_out.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), table.data_ptr<int32_t>(),
                            points.data_ptr<scalar_t>(), grad_points.data_ptr<scalar_t>(), n, s);
    }
  });
  return outputs();
}

}  // namespace cuda_ext
