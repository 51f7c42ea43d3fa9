// CUDA kernels of the sparse brick-grid lookup brick_grid_interpolate (values (M, C) rows found through an
// int32 brick table, at (N, 3) points), forward and backward. float32/float64/float16/bfloat16,
// accumulation in float32 (float64 for float64), 64-bit offsets throughout. Geometry and validation:
// ../brick_grid.h; the layouts follow the dense lookup's (grid_interpolate.cu, grid_interpolate_backward.cu).
//
// Each corner is located on its own: up to 8 table entries per point (the table is a few MB and stays in
// L2), then the corner's C contiguous values, with 4-channel vector loads when C % 4 == 0.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "brick_grid.h"
#include "kernel_common.h"
#include "ops.h"
#include "vector_memory.cuh"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;

// Corner k's channel vector at `channel` of its row, or zeros for an empty brick's corner. The zeros are
// still blended with the corner's weight, so a NaN point gives a NaN row as in the dense lookup.
template <typename scalar_t, typename acc_t, int VEC>
__device__ __forceinline__ void load_corner(const scalar_t* __restrict__ values, int64_t row, int64_t channels,
                                            int64_t channel, acc_t (&out)[VEC]) {
  if (row >= 0) {
    widen(load_vec<scalar_t, VEC, false>(values + row * channels + channel), out);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = acc_t(0);
  }
}

// A group of G = min(C / VEC, 4) lanes per point, lane g blending channel vectors g, g + G, ... of the 8
// corners (the dense forward's layout: no reduction across lanes, each load reads one row's contiguous
// channels). The lanes of a group locate the same corners; their table reads are the same addresses.
template <typename scalar_t, int VEC, int kGroup>
__global__ void __launch_bounds__(kThreads)
    brick_forward_kernel(const scalar_t* __restrict__ values, const int32_t* __restrict__ table,
                         const scalar_t* __restrict__ points, scalar_t* __restrict__ out, int64_t n_points,
                         BrickShape s) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kPointsPerWarp = 32 / kGroup;  // G = 3 leaves lanes 30 and 31 idle
  const int lane = threadIdx.x % 32, g = lane % kGroup;
  const int64_t n = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32 * kPointsPerWarp + lane / kGroup;
  if (lane >= kPointsPerWarp * kGroup || n >= n_points) return;
  const scalar_t* point = points + 3 * n;
  const BrickCorners<acc_t> c = locate_brick_corners<acc_t>(static_cast<acc_t>(point[0]), static_cast<acc_t>(point[1]),
                                                            static_cast<acc_t>(point[2]), s);
  int64_t row[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) row[k] = c.row(k, table, s);
#pragma unroll 1
  for (int64_t v = g; v < s.channels / VEC; v += kGroup) {
    // All 8 gathers first, then the blend: their latencies overlap.
    acc_t corner[8][VEC];
#pragma unroll
    for (int k = 0; k < 8; ++k) load_corner<scalar_t, acc_t, VEC>(values, row[k], s.channels, v * VEC, corner[k]);
    acc_t acc[VEC] = {};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const acc_t w = c.weight(k);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += w * corner[k][e];
    }
    store_vec(out + n * s.channels + v * VEC, narrow<scalar_t>(acc));
  }
}

// The dense backward's quad layout: lane q of a point's 4 lanes owns corners q (low along axis 0) and q + 4
// (high), scatters w_k * grad_out into their rows with atomics (float4 atomics on sm_90 through
// atomic_add_vec), and forms their dot products with grad_out; the quad gathers the 8 dot products with
// shuffles for the point gradient. Empty corners add nothing and have d_k = 0.
constexpr int kQuad = 4;

template <typename scalar_t, int VEC, bool kValuesGrad, bool kPointsGrad>
__global__ void __launch_bounds__(kThreads)
    brick_backward_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ values,
                          const int32_t* __restrict__ table, const scalar_t* __restrict__ points,
                          at::opmath_type<scalar_t>* __restrict__ grad_values, scalar_t* __restrict__ grad_points,
                          int64_t n_points, BrickShape s) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int q = static_cast<int>(thread % kQuad);
  const bool active = thread / kQuad < n_points;
  // Lanes past the end take part in the quad's shuffles on a copy of the last point, writing nothing.
  const int64_t n = active ? thread / kQuad : n_points - 1;
  const int64_t channels = s.channels;
  const scalar_t* point = points + 3 * n;
  const BrickCorners<acc_t> c = locate_brick_corners<acc_t>(static_cast<acc_t>(point[0]), static_cast<acc_t>(point[1]),
                                                            static_cast<acc_t>(point[2]), s);
  const int64_t row_lo = c.row(q, table, s), row_hi = c.row(q + 4, table, s);
  const acc_t weight_lo = c.weight(q), weight_hi = c.weight(q + 4);
  acc_t dot_lo = acc_t(0), dot_hi = acc_t(0);
  for (int64_t j = 0; j < channels; j += VEC) {
    acc_t g[VEC];
    widen(load_vec<scalar_t, VEC, false>(grad_out + n * channels + j), g);
    if (kValuesGrad && active) {
      acc_t add_lo[VEC], add_hi[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        add_lo[e] = weight_lo * g[e];
        add_hi[e] = weight_hi * g[e];
      }
      if (row_lo >= 0) atomic_add_vec(grad_values + row_lo * channels + j, add_lo);
      if (row_hi >= 0) atomic_add_vec(grad_values + row_hi * channels + j, add_hi);
    }
    if (kPointsGrad) {
      acc_t value_lo[VEC], value_hi[VEC];
      load_corner<scalar_t, acc_t, VEC>(values, row_lo, channels, j, value_lo);
      load_corner<scalar_t, acc_t, VEC>(values, row_hi, channels, j, value_hi);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        dot_lo += g[e] * value_lo[e];
        dot_hi += g[e] * value_hi[e];
      }
    }
  }
  if (kPointsGrad) {
    acc_t dots[8];  // corner k = 4*b0 + q lives in lane q = k % 4 of the quad, as its lo (b0 = 0) or hi
#pragma unroll
    for (int k = 0; k < 8; ++k) dots[k] = __shfl_sync(0xffffffffu, (k & 4) ? dot_hi : dot_lo, k & 3, kQuad);
    if (active && q == 0) {
      acc_t grad[3];
      grid_point_grads(c, dots, grad);
#pragma unroll
      for (int i = 0; i < 3; ++i) grad_points[3 * n + i] = static_cast<scalar_t>(grad[i]);
    }
  }
}

}  // namespace

// ------------------------------------------------------------------------------ entry points

at::Tensor brick_grid_interpolate_cuda(const at::Tensor& values_in, const at::Tensor& table_in,
                                       const at::Tensor& points_in, at::IntArrayRef shape, int64_t brick) {
  const char* op = "brick_grid_interpolate";
  check_brick_grid_inputs(values_in, table_in, points_in, shape, brick, at::kCUDA, op);
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor values = values_in.contiguous(), table = table_in.contiguous(), points = points_in.contiguous();
  const int64_t n = points.size(0), channels = values.size(1);
  at::Tensor out = at::empty({n, channels}, values.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "brick_grid_interpolate_cuda", [&] {
    const scalar_t* values_ptr = values.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t vec_bytes = kGridVec * sizeof(scalar_t);
    // Rows start at multiples of C elements: with C % 4 == 0 and aligned bases every vector is aligned.
    const bool wide = channels % kGridVec == 0 && aligned_to(values_ptr, vec_bytes) && aligned_to(out_ptr, vec_bytes);
    with_vector_width<kGridVec>(wide, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const int64_t vecs = channels / VEC;
      with_lane_group(vecs < 4 ? vecs : 4, [&](auto group) {
        constexpr int kGroup = decltype(group)::value;
        const int64_t warps = (n + 32 / kGroup - 1) / (32 / kGroup);
        brick_forward_kernel<scalar_t, VEC, kGroup>
            <<<block_count(32 * warps, kThreads, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                values_ptr, table.data_ptr<int32_t>(), points.data_ptr<scalar_t>(), out_ptr, n,
                brick_shape(values, table, shape, brick));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> brick_grid_interpolate_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& values_in, const at::Tensor& table_in, const at::Tensor& points_in,
    at::IntArrayRef shape, int64_t brick, bool values_requires_grad, bool points_requires_grad,
    const std::optional<at::Tensor>& grad_into) {
  const char* op = "brick_grid_interpolate_backward";
  check_brick_grid_inputs(values_in, table_in, points_in, shape, brick, at::kCUDA, op);
  const int64_t n = points_in.size(0), channels = values_in.size(1);
  check_grad_out(grad_out_in, n, channels, values_in, "values", op);
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous(), values = values_in.contiguous(), table = table_in.contiguous(),
                   points = points_in.contiguous();
  // Atomics accumulate in float32 for half/bfloat16 (then cast), in place for float32/float64.
  const auto acc_dtype = at::toOpMathType(values.scalar_type());
  at::Tensor grad_acc = lookup_grad_target(values, grad_into, values_requires_grad, "values", op);
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  if (grad_out.numel() > 0 && (values_requires_grad || points_requires_grad)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, values.scalar_type(), "brick_grid_interpolate_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const scalar_t* grad_out_ptr = grad_out.data_ptr<scalar_t>();
          const scalar_t* values_ptr = values.data_ptr<scalar_t>();
          const int64_t vec_bytes = kGridVec * sizeof(scalar_t);
          acc_t* grad_acc_ptr = values_requires_grad ? grad_acc.data_ptr<acc_t>() : nullptr;
          const bool wide = channels % kGridVec == 0 && aligned_to(grad_out_ptr, vec_bytes) &&
                            aligned_to(values_ptr, vec_bytes) &&
                            (grad_acc_ptr == nullptr || aligned_to(grad_acc_ptr, kGridVec * sizeof(acc_t)));
          scalar_t* grad_points_ptr = points_requires_grad ? grad_points.data_ptr<scalar_t>() : nullptr;
          with_vector_width<kGridVec>(wide, [&](auto vec) {
            with_gradient_flags(values_requires_grad, points_requires_grad, [&](auto values_grad, auto points_grad) {
              brick_backward_kernel<scalar_t, decltype(vec)::value, decltype(values_grad)::value,
                                    decltype(points_grad)::value>
                  <<<block_count(kQuad * n, kThreads, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                      grad_out_ptr, values_ptr, table.data_ptr<int32_t>(), points.data_ptr<scalar_t>(), grad_acc_ptr,
                      grad_points_ptr, n, brick_shape(values, table, shape, brick));
              C10_CUDA_KERNEL_LAUNCH_CHECK();
            });
          });
        });
  }
  if (grad_into) return {no_grad_placeholder(values), grad_points};  // added onto the caller's tensor
  at::Tensor grad_values =
      values_requires_grad && acc_dtype != values.scalar_type() ? grad_acc.to(values.scalar_type()) : grad_acc;
  return {grad_values, grad_points};
}

}  // namespace cuda_ext
