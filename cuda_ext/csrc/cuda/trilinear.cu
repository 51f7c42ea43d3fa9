// CUDA kernels of the pairwise op trilinear_interpolate ((N, 8, F) corners at (N, 3) points), forward
// and backward. float32/float64/float16/bfloat16, accumulation in float32 (float64 for float64), 64-bit
// offsets throughout. Weight math and validation: ../trilinear.h.
//
// Memory bound, every byte read or written once: a group of G lanes (a power of two <= 32, inside one
// warp) owns a point and walks its F features in 16-byte vectors, G vectors apart, so each corner row is
// read with coalesced 16-byte loads and the point's weights are computed once per lane. The backward for
// feats is a pure streaming write (w_k * grad_out); the point gradient needs a reduction over F, done with
// shuffles inside the group in the same pass and written by lane 0: no atomics, no zero-fill.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernel_common.h"
#include "ops.h"
#include "trilinear.h"
#include "vector_memory.cuh"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;

// Pairwise kernels move 16-byte vectors of features: 4 float, 8 half/bfloat16, 2 double.
template <typename scalar_t>
constexpr int kPairVec = 16 / static_cast<int>(sizeof(scalar_t));

// How lanes are assigned to points: 2^group_shift lanes per point.
struct PairLayout {
  int group_shift;
  unsigned int blocks;
};

PairLayout pair_layout(int64_t n_points, int64_t vectors_per_point, const char* op) {
  int shift = 0;
  while (shift < 5 && (int64_t(1) << shift) < vectors_per_point) ++shift;
  return {shift, block_count(n_points << shift, kThreads, op)};
}

template <typename acc_t, typename scalar_t>
__device__ __forceinline__ void load_fractions(const scalar_t* __restrict__ point, acc_t t[3]) {
#pragma unroll
  for (int a = 0; a < 3; ++a) t[a] = local_fraction(static_cast<acc_t>(point[a]));
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    pair_forward_kernel(const scalar_t* __restrict__ feats, const scalar_t* __restrict__ points,
                        scalar_t* __restrict__ out, int64_t n_points, int64_t f, int group_shift) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> group_shift;
  if (n >= n_points) return;
  const int lane = threadIdx.x & ((1 << group_shift) - 1);
  acc_t t[3], w[8];
  load_fractions(points + 3 * n, t);
  pair_corner_weights(t[0], t[1], t[2], w);
  const scalar_t* corners = feats + n * 8 * f;
  scalar_t* row = out + n * f;
  for (int64_t j = int64_t(lane) * VEC; j < f; j += int64_t(VEC) << group_shift) {
    acc_t acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = acc_t(0);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      acc_t v[VEC];
      widen(load_vec<scalar_t, VEC, true>(corners + k * f + j), v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += w[k] * v[e];
    }
    store_vec(row + j, narrow<scalar_t>(acc));
  }
}

template <typename scalar_t, int VEC, bool kFeatsGrad, bool kPointsGrad>
__global__ void __launch_bounds__(kThreads)
    pair_backward_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ feats,
                         const scalar_t* __restrict__ points, scalar_t* __restrict__ grad_feats,
                         scalar_t* __restrict__ grad_points, int64_t n_points, int64_t f, int group_shift) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> group_shift;
  const bool active = n < n_points;
  // Lanes past the end stay for the group shuffles below (whole warps must take part).
  if (!kPointsGrad && !active) return;
  const int lane = threadIdx.x & ((1 << group_shift) - 1);
  acc_t t[3] = {acc_t(0), acc_t(0), acc_t(0)}, w[8];
  if (active) load_fractions(points + 3 * n, t);
  pair_corner_weights(t[0], t[1], t[2], w);
  acc_t dots[8];  // <grad_out, feats[n, k]> over this lane's features
#pragma unroll
  for (int k = 0; k < 8; ++k) dots[k] = acc_t(0);
  const int64_t end = active ? f : 0;
  for (int64_t j = int64_t(lane) * VEC; j < end; j += int64_t(VEC) << group_shift) {
    acc_t g[VEC];
    widen(load_vec<scalar_t, VEC, true>(grad_out + n * f + j), g);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (kFeatsGrad) {
        acc_t out[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = w[k] * g[e];
        store_vec(grad_feats + (n * 8 + k) * f + j, narrow<scalar_t>(out));
      }
      if (kPointsGrad) {
        acc_t v[VEC];
        widen(load_vec<scalar_t, VEC, true>(feats + (n * 8 + k) * f + j), v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dots[k] += g[e] * v[e];
      }
    }
  }
  if (kPointsGrad) {
    acc_t grad[3];
    pair_fraction_grads(t[0], t[1], t[2], dots, grad);  // linear in dots: reduce after combining
    const int group = 1 << group_shift;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      for (int offset = group / 2; offset > 0; offset /= 2) {
        grad[a] += __shfl_xor_sync(0xffffffffu, grad[a], offset, group);
      }
    }
    if (active && lane == 0) {
#pragma unroll
      for (int a = 0; a < 3; ++a) grad_points[3 * n + a] = static_cast<scalar_t>(grad[a] / acc_t(2));  // du/dx
    }
  }
}

}  // namespace

// ------------------------------------------------------------------------------ entry points

at::Tensor trilinear_interpolate_cuda(const at::Tensor& feats_in, const at::Tensor& points_in) {
  const char* op = "trilinear_interpolate";
  check_pair_inputs(feats_in, points_in, at::kCUDA, op);
  const c10::cuda::CUDAGuard guard(feats_in.device());
  const at::Tensor feats = feats_in.contiguous(), points = points_in.contiguous();
  const int64_t n = feats.size(0), f = feats.size(2);
  at::Tensor out = at::empty({n, f}, feats.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "trilinear_interpolate_cuda", [&] {
    constexpr int kVec = kPairVec<scalar_t>;
    const scalar_t* feats_ptr = feats.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const bool wide = f % kVec == 0 && aligned_to(feats_ptr, 16) && aligned_to(out_ptr, 16);
    with_vector_width<kVec>(wide, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const PairLayout layout = pair_layout(n, f / VEC + (f % VEC != 0), op);
      pair_forward_kernel<scalar_t, VEC><<<layout.blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          feats_ptr, points.data_ptr<scalar_t>(), out_ptr, n, f, layout.group_shift);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> trilinear_interpolate_backward_cuda(const at::Tensor& grad_out_in,
                                                                       const at::Tensor& feats_in,
                                                                       const at::Tensor& points_in,
                                                                       bool feats_requires_grad,
                                                                       bool points_requires_grad) {
  const char* op = "trilinear_interpolate_backward";
  check_pair_inputs(feats_in, points_in, at::kCUDA, op);
  const int64_t n = feats_in.size(0), f = feats_in.size(2);
  check_grad_out(grad_out_in, n, f, feats_in, "feats", op);
  const c10::cuda::CUDAGuard guard(feats_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous(), feats = feats_in.contiguous(), points = points_in.contiguous();
  at::Tensor grad_feats = feats_requires_grad ? at::empty({n, 8, f}, feats.options()) : no_grad_placeholder(feats);
  at::Tensor grad_points = points_requires_grad ? at::empty({n, 3}, points.options()) : no_grad_placeholder(points);
  if (points_requires_grad && f == 0) grad_points.zero_();  // no features: the gradient is exactly 0
  if (n == 0 || f == 0 || !(feats_requires_grad || points_requires_grad)) return {grad_feats, grad_points};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, feats.scalar_type(), "trilinear_interpolate_backward_cuda", [&] {
        constexpr int kVec = kPairVec<scalar_t>;
        const scalar_t* grad_out_ptr = grad_out.data_ptr<scalar_t>();
        const scalar_t* feats_ptr = feats.data_ptr<scalar_t>();
        scalar_t* grad_feats_ptr = feats_requires_grad ? grad_feats.data_ptr<scalar_t>() : nullptr;
        scalar_t* grad_points_ptr = points_requires_grad ? grad_points.data_ptr<scalar_t>() : nullptr;
        const bool wide = f % kVec == 0 && aligned_to(grad_out_ptr, 16) && aligned_to(feats_ptr, 16) &&
                          aligned_to(grad_feats_ptr, 16);  // nullptr counts as aligned
        with_vector_width<kVec>(wide, [&](auto vec) {
          constexpr int VEC = decltype(vec)::value;
          const PairLayout layout = pair_layout(n, f / VEC + (f % VEC != 0), op);
          with_gradient_flags(feats_requires_grad, points_requires_grad, [&](auto feats_grad, auto points_grad) {
            pair_backward_kernel<scalar_t, VEC, decltype(feats_grad)::value, decltype(points_grad)::value>
                <<<layout.blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                    grad_out_ptr, feats_ptr, points.data_ptr<scalar_t>(), grad_feats_ptr, grad_points_ptr, n, f,
                    layout.group_shift);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
      });
  return {grad_feats, grad_points};
}

}  // namespace cuda_ext
