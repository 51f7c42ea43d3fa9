// volume_render on CUDA: one warp per ray (render.h has the formulas).
//
// Why a warp and not a thread per ray: a ray's samples are contiguous, so 32 lanes reading 32 consecutive
// samples (and their value rows) read consecutive memory, where 32 threads on 32 rays would each stream a
// different place. The transmittance is a prefix sum along the ray: a warp scan per chunk of 32 samples,
// plus the carry of the chunks before. Each lane accumulates its samples' w_i v_i in registers (C is a
// template bound: 4, 16 or 64 channels) and the warp reduces them once per ray. Early termination stops a
// ray's loop at the first chunk whose carried transmittance is below early_stop.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernel_common.h"
#include "ops.h"
#include "render.h"

namespace cuda_ext {
namespace {

constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;
constexpr int kRaysPerBlock = kBlockThreads / kWarp;
constexpr unsigned kAll = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x, int lane) {
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const T y = __shfl_up_sync(kAll, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) x += __shfl_xor_sync(kAll, x, d);
  return x;
}

__device__ __forceinline__ float exp_of(float x) { return __expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float expm1_of(float x) { return expm1f(x); }
__device__ __forceinline__ double expm1_of(double x) { return expm1(x); }

struct RayRange {
  int64_t first, last;
};

__device__ __forceinline__ RayRange ray_range(const int64_t* offsets, int64_t b, int64_t n) {
  return {max(offsets[b], int64_t(0)), min(offsets[b + 1], n)};
}

template <typename scalar_t, int kMaxC>
__global__ void __launch_bounds__(kBlockThreads)
    render_forward_kernel(const scalar_t* __restrict__ sd, const scalar_t* __restrict__ v,
                          const scalar_t* __restrict__ t, const int64_t* __restrict__ offsets, int64_t rays, int64_t n,
                          int channels, scalar_t early_stop, scalar_t* __restrict__ out, scalar_t* __restrict__ opacity,
                          scalar_t* __restrict__ depth) {
  const int lane = threadIdx.x % kWarp;
  const int64_t b = int64_t(blockIdx.x) * kRaysPerBlock + threadIdx.x / kWarp;
  if (b >= rays) return;  // whole warps leave together
  const RayRange range = ray_range(offsets, b, n);
  scalar_t acc[kMaxC];
#pragma unroll
  for (int c = 0; c < kMaxC; ++c) acc[c] = 0;
  scalar_t carry = 0, op = 0, dp = 0;  // carry: optical depth of the chunks before
  for (int64_t base = range.first; base < range.last; base += kWarp) {
    const int64_t i = base + lane;
    const bool valid = i < range.last;
    const scalar_t s = valid ? sd[i] : scalar_t(0);
    const scalar_t inclusive = warp_inclusive_scan(s, lane);
    const scalar_t transmittance = exp_of(-(carry + inclusive - s));
    if (valid && transmittance >= early_stop) {
      const scalar_t w = -transmittance * expm1_of(-s);
      const scalar_t* row = v + i * channels;
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) {
        if (c < channels) acc[c] += w * row[c];
      }
      op += w;
      dp += w * t[i];
    }
    carry += __shfl_sync(kAll, inclusive, kWarp - 1);
    if (exp_of(-carry) < early_stop) break;  // every later sample is below too (carry is warp-uniform)
  }
  op = warp_sum(op);
  dp = warp_sum(dp);
#pragma unroll
  for (int c = 0; c < kMaxC; ++c) {
    if (c < channels) {
      const scalar_t total = warp_sum(acc[c]);
      if (lane == 0) out[b * channels + c] = total;
    }
  }
  if (lane == 0) {
    opacity[b] = op;
    depth[b] = dp;
  }
}

template <typename scalar_t, int kMaxC>
__global__ void __launch_bounds__(kBlockThreads)
    render_backward_kernel(const scalar_t* __restrict__ sd, const scalar_t* __restrict__ v,
                           const scalar_t* __restrict__ t, const int64_t* __restrict__ offsets, int64_t rays, int64_t n,
                           int channels, scalar_t early_stop, const scalar_t* __restrict__ out,
                           const scalar_t* __restrict__ opacity, const scalar_t* __restrict__ depth,
                           const scalar_t* __restrict__ g_out, const scalar_t* __restrict__ g_op,
                           const scalar_t* __restrict__ g_dp, scalar_t* __restrict__ g_sd, scalar_t* __restrict__ g_v) {
  const int lane = threadIdx.x % kWarp;
  const int64_t b = int64_t(blockIdx.x) * kRaysPerBlock + threadIdx.x / kWarp;
  if (b >= rays) return;
  const RayRange range = ray_range(offsets, b, n);
  scalar_t go[kMaxC];
  scalar_t total = g_op[b] * opacity[b] + g_dp[b] * depth[b];  // G_b = sum_i w_i g_i, from the outputs
#pragma unroll
  for (int c = 0; c < kMaxC; ++c) {
    go[c] = c < channels ? g_out[b * channels + c] : scalar_t(0);
    if (c < channels) total += go[c] * out[b * channels + c];
  }
  scalar_t carry = 0, prefix_carry = 0;  // optical depth and sum w g of the chunks before
  for (int64_t base = range.first; base < range.last; base += kWarp) {
    const int64_t i = base + lane;
    const bool valid = i < range.last;
    const scalar_t s = valid ? sd[i] : scalar_t(0);
    const scalar_t inclusive = warp_inclusive_scan(s, lane);
    const scalar_t transmittance = exp_of(-(carry + inclusive - s));
    const bool alive = valid && transmittance >= early_stop;
    // w as the forward computes it (expm1: T_i - T_{i+1} would cancel for small s), T_{i+1} = T_i - w_i
    const scalar_t w = alive ? -transmittance * expm1_of(-s) : scalar_t(0);
    const scalar_t after = transmittance - w;
    scalar_t g = 0;
    if (alive) {
      g = g_op[b] + g_dp[b] * t[i];
      const scalar_t* row = v + i * channels;
      scalar_t* g_row = g_v + i * channels;
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) {
        if (c < channels) {
          g += go[c] * row[c];
          g_row[c] = w * go[c];
        }
      }
    }
    const scalar_t prefix = prefix_carry + warp_inclusive_scan(w * g, lane);
    if (alive) g_sd[i] = after * g - (total - prefix);
    carry += __shfl_sync(kAll, inclusive, kWarp - 1);
    prefix_carry = __shfl_sync(kAll, prefix, kWarp - 1);
    if (exp_of(-carry) < early_stop) break;
  }
}

// Calls fn(std::integral_constant<int, kMaxC>) with the smallest channel bound that holds `channels`.
template <typename Fn>
void dispatch_channels(int64_t channels, Fn&& fn) {
  if (channels <= 4) {
    fn(std::integral_constant<int, 4>{});
  } else if (channels <= 16) {
    fn(std::integral_constant<int, 16>{});
  } else {
    fn(std::integral_constant<int, 64>{});
  }
}

void check_channels(int64_t channels, const char* op) {
  TORCH_CHECK(channels <= 64, op, ": values may have at most 64 channels on CUDA, got ", channels);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> volume_render_cuda(const at::Tensor& optical_depth_in,
                                                                  const at::Tensor& values_in, const at::Tensor& t_in,
                                                                  const at::Tensor& ray_offsets_in, double early_stop) {
  check_render_inputs(optical_depth_in, values_in, t_in, ray_offsets_in, early_stop, at::kCUDA, "volume_render");
  check_channels(values_in.size(1), "volume_render");
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), v = values_in.contiguous(), t = t_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous();
  const int64_t rays = offsets.size(0) - 1, channels = v.size(1);
  at::Tensor out = at::empty({rays, channels}, v.options());
  at::Tensor opacity = at::empty({rays}, v.options()), depth = at::empty({rays}, v.options());
  if (rays == 0) return {out, opacity, depth};
  const unsigned int blocks = block_count(rays * kWarp, kBlockThreads, "volume_render");
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "volume_render_cuda", [&] {
    dispatch_channels(channels, [&](auto bound) {
      render_forward_kernel<scalar_t, decltype(bound)::value>
          <<<blocks, kBlockThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              sd.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), t.const_data_ptr<scalar_t>(),
              offsets.const_data_ptr<int64_t>(), rays, sd.size(0), static_cast<int>(channels),
              static_cast<scalar_t>(early_stop), out.data_ptr<scalar_t>(), opacity.data_ptr<scalar_t>(),
              depth.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {out, opacity, depth};
}

std::tuple<at::Tensor, at::Tensor> volume_render_backward_cuda(
    const at::Tensor& grad_values_in, const at::Tensor& grad_opacity_in, const at::Tensor& grad_depth_in,
    const at::Tensor& optical_depth_in, const at::Tensor& values_in, const at::Tensor& t_in,
    const at::Tensor& ray_offsets_in, const at::Tensor& out_in, const at::Tensor& opacity_in,
    const at::Tensor& depth_in, double early_stop) {
  const char* op = "volume_render_backward";
  check_render_inputs(optical_depth_in, values_in, t_in, ray_offsets_in, early_stop, at::kCUDA, op);
  check_channels(values_in.size(1), op);
  const int64_t rays = ray_offsets_in.size(0) - 1;
  check_render_grads(grad_values_in, grad_opacity_in, grad_depth_in, values_in, rays, op);
  check_render_grads(out_in, opacity_in, depth_in, values_in, rays, op);
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), v = values_in.contiguous(), t = t_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous(), out = out_in.contiguous();
  const at::Tensor opacity = opacity_in.contiguous(), depth = depth_in.contiguous();
  const at::Tensor g_out = grad_values_in.contiguous(), g_op = grad_opacity_in.contiguous();
  const at::Tensor g_dp = grad_depth_in.contiguous();
  at::Tensor g_sd = at::zeros_like(sd), g_v = at::zeros_like(v);  // samples a ray never reaches get zero
  if (rays == 0) return {g_sd, g_v};
  const int64_t channels = v.size(1);
  const unsigned int blocks = block_count(rays * kWarp, kBlockThreads, op);
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "volume_render_backward_cuda", [&] {
    dispatch_channels(channels, [&](auto bound) {
      render_backward_kernel<scalar_t, decltype(bound)::value>
          <<<blocks, kBlockThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              sd.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), t.const_data_ptr<scalar_t>(),
              offsets.const_data_ptr<int64_t>(), rays, sd.size(0), static_cast<int>(channels),
              static_cast<scalar_t>(early_stop), out.const_data_ptr<scalar_t>(), opacity.const_data_ptr<scalar_t>(),
              depth.const_data_ptr<scalar_t>(), g_out.const_data_ptr<scalar_t>(), g_op.const_data_ptr<scalar_t>(),
              g_dp.const_data_ptr<scalar_t>(), g_sd.data_ptr<scalar_t>(), g_v.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {g_sd, g_v};
}

}  // namespace cuda_ext
