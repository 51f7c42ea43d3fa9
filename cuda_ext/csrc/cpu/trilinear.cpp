// CPU kernels of the trilinear family: the pairwise (N, 8, F) blend and the fused dense-grid
// lookup, forward and backward. float32/float64, 64-bit indexing, at::parallel_for over points.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "trilinear.h"

namespace cuda_ext {
namespace {

using namespace trilinear;

// Points per parallel_for task, so that a task touches roughly GRAIN_SIZE elements.
int64_t grain_for(int64_t elements_per_point) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elements_per_point));
}

at::Tensor no_grad_placeholder(const at::Tensor& like) { return at::empty({0}, like.options()); }

// ------------------------------------------------------------------------------ pairwise

template <typename scalar_t>
void pair_weights(const scalar_t* point, scalar_t w[8]) {
  pair_corner_weights(local_fraction(point[0]), local_fraction(point[1]), local_fraction(point[2]), w);
}

template <typename scalar_t>
void pair_forward(const scalar_t* feats, const scalar_t* points, scalar_t* out, int64_t n_points, int64_t f) {
  at::parallel_for(0, n_points, grain_for(9 * f), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      scalar_t w[8];
      pair_weights(points + 3 * n, w);
      const scalar_t* c = feats + n * 8 * f;
      scalar_t* o = out + n * f;
      for (int64_t j = 0; j < f; ++j) {
        o[j] = w[0] * c[j] + w[1] * c[f + j] + w[2] * c[2 * f + j] + w[3] * c[3 * f + j] + w[4] * c[4 * f + j] +
               w[5] * c[5 * f + j] + w[6] * c[6 * f + j] + w[7] * c[7 * f + j];
      }
    }
  });
}

// grad_feats[n,k,:] = w_k * grad_out[n,:]; grad_points from the 8 dots <grad_out, feats[n,k]>.
// Either output pointer may be null (gradient not requested).
template <typename scalar_t>
void pair_backward(const scalar_t* grad_out, const scalar_t* feats, const scalar_t* points, scalar_t* grad_feats,
                   scalar_t* grad_points, int64_t n_points, int64_t f) {
  at::parallel_for(0, n_points, grain_for(17 * f), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const scalar_t* g = grad_out + n * f;
      const scalar_t* p = points + 3 * n;
      scalar_t w[8];
      pair_weights(p, w);
      if (grad_feats) {
        scalar_t* gf = grad_feats + n * 8 * f;
        for (int k = 0; k < 8; ++k) {
          for (int64_t j = 0; j < f; ++j) gf[k * f + j] = w[k] * g[j];
        }
      }
      if (grad_points) {
        const scalar_t* c = feats + n * 8 * f;
        scalar_t dots[8];
        for (int k = 0; k < 8; ++k) {
          scalar_t acc = 0;
          for (int64_t j = 0; j < f; ++j) acc += g[j] * c[k * f + j];
          dots[k] = acc;
        }
        scalar_t grad[3];
        pair_fraction_grads(local_fraction(p[0]), local_fraction(p[1]), local_fraction(p[2]), dots, grad);
        for (int a = 0; a < 3; ++a) grad_points[3 * n + a] = grad[a] / scalar_t(2);  // du/dx = 1/2
      }
    }
  });
}

// ------------------------------------------------------------------------------ grid

struct GridShape {
  int64_t r0, r1, r2, channels;
};

GridShape grid_shape(const at::Tensor& grid) { return {grid.size(0), grid.size(1), grid.size(2), grid.size(3)}; }

template <typename scalar_t>
void locate(const scalar_t* point, const GridShape& s, GridCorners<scalar_t>& c) {
  locate_in_grid(point[0], point[1], point[2], s.r0, s.r1, s.r2, s.channels, c);
}

template <typename scalar_t>
void grid_forward(const scalar_t* grid, const scalar_t* points, scalar_t* out, int64_t n_points, GridShape s) {
  const int64_t ch = s.channels;
  at::parallel_for(0, n_points, grain_for(9 * ch), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      GridCorners<scalar_t> c;
      locate(points + 3 * n, s, c);
      scalar_t* o = out + n * ch;
      for (int64_t j = 0; j < ch; ++j) {
        scalar_t acc = 0;
        for (int k = 0; k < 8; ++k) acc += c.weight[k] * grid[c.offset[k] + j];
        o[j] = acc;
      }
    }
  });
}

template <typename scalar_t>
void grid_point_grads_cpu(const scalar_t* grad_out, const scalar_t* grid, const scalar_t* points,
                          scalar_t* grad_points, int64_t n_points, GridShape s) {
  const int64_t ch = s.channels;
  at::parallel_for(0, n_points, grain_for(9 * ch), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      GridCorners<scalar_t> c;
      locate(points + 3 * n, s, c);
      const scalar_t* g = grad_out + n * ch;
      scalar_t dots[8];
      for (int k = 0; k < 8; ++k) {
        scalar_t acc = 0;
        for (int64_t j = 0; j < ch; ++j) acc += g[j] * grid[c.offset[k] + j];
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
        GridCorners<scalar_t> c;
        locate(points + 3 * n, s, c);
        const scalar_t* g = grad_out + n * ch;
        for (int k = 4 * pass; k < 4 * pass + 4; ++k) {  // corners 0-3 have i0 = lo0, 4-7 have i0 = hi0
          scalar_t* dst = grad_grid + c.offset[k];
          const scalar_t w = c.weight[k];
          for (int64_t j = 0; j < ch; ++j) dst[j] += w * g[j];
        }
      }
    });
  }
}

}  // namespace

// ------------------------------------------------------------------------------ entry points

at::Tensor trilinear_interpolate_cpu(const at::Tensor& feats_in, const at::Tensor& points_in) {
  check_pair_inputs(feats_in, points_in, at::kCPU, "trilinear_interpolate");
  const at::Tensor feats = feats_in.contiguous(), points = points_in.contiguous();
  const int64_t n = feats.size(0), f = feats.size(2);
  at::Tensor out = at::empty({n, f}, feats.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(feats.scalar_type(), "trilinear_interpolate_cpu", [&] {
    pair_forward(feats.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, f);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> trilinear_interpolate_backward_cpu(const at::Tensor& grad_out_in,
                                                                     const at::Tensor& feats_in,
                                                                     const at::Tensor& points_in,
                                                                     bool feats_requires_grad,
                                                                     bool points_requires_grad) {
  const char* op = "trilinear_interpolate_backward";
  check_pair_inputs(feats_in, points_in, at::kCPU, op);
  const int64_t n = feats_in.size(0), f = feats_in.size(2);
  check_grad_out(grad_out_in, n, f, feats_in, "feats", op);
  const at::Tensor grad_out = grad_out_in.contiguous(), feats = feats_in.contiguous(), points = points_in.contiguous();
  at::Tensor grad_feats = feats_requires_grad ? at::empty({n, 8, f}, feats.options()) : no_grad_placeholder(feats);
  // zeros: with F == 0 no kernel runs and the gradient is exactly 0.
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  if (n == 0 || f == 0 || !(feats_requires_grad || points_requires_grad)) return {grad_feats, grad_points};
  AT_DISPATCH_FLOATING_TYPES(feats.scalar_type(), "trilinear_interpolate_backward_cpu", [&] {
    pair_backward(grad_out.data_ptr<scalar_t>(), feats.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(),
                  feats_requires_grad ? grad_feats.data_ptr<scalar_t>() : nullptr,
                  points_requires_grad ? grad_points.data_ptr<scalar_t>() : nullptr, n, f);
  });
  return {grad_feats, grad_points};
}

at::Tensor grid_interpolate_cpu(const at::Tensor& grid_in, const at::Tensor& points_in) {
  check_grid_inputs(grid_in, points_in, at::kCPU, "grid_interpolate");
  reorder_mode("grid_interpolate");  // validated on both backends; the CPU kernel visits points as given
  const at::Tensor grid = grid_in.contiguous(), points = points_in.contiguous();
  const int64_t n = points.size(0);
  at::Tensor out = at::empty({n, grid.size(3)}, grid.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(grid.scalar_type(), "grid_interpolate_cpu", [&] {
    grid_forward(grid.data_ptr<scalar_t>(), points.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n,
                 grid_shape(grid));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> grid_interpolate_backward_cpu(const at::Tensor& grad_out_in,
                                                                const at::Tensor& grid_in,
                                                                const at::Tensor& points_in, bool grid_requires_grad,
                                                                bool points_requires_grad) {
  const char* op = "grid_interpolate_backward";
  check_grid_inputs(grid_in, points_in, at::kCPU, op);
  const int64_t n = points_in.size(0);
  check_grad_out(grad_out_in, n, grid_in.size(3), grid_in, "grid", op);
  const at::Tensor grad_out = grad_out_in.contiguous(), grid = grid_in.contiguous(), points = points_in.contiguous();
  at::Tensor grad_grid = grid_requires_grad ? at::zeros(grid.sizes(), grid.options()) : no_grad_placeholder(grid);
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  if (grad_out.numel() == 0) return {grad_grid, grad_points};
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
  return {grad_grid, grad_points};
}

}  // namespace cuda_ext
