// distortion_loss on CUDA: one warp per ray, 32 samples at a time, as volume_render (render.cu says why a warp:
// a ray's samples are contiguous, so the lanes read consecutive memory). distortion.h has the formulas: per chunk,
// three warp scans (the optical depth for T_i, then the weights w_i and moments w_i m_i for W_i and M_i), each
// carried over the chunks before. The backward runs that pass twice: the ray's totals W, M and L_b first, then
// the gradients with a fourth scan (the running sum of w G). Every sample's gradient is written (zero for a
// sample in no ray; after the last ray by a grid-wide pass from the last offset), so the output needs no memset.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "distortion.h"
#include "kernel_common.h"
#include "ops.h"
#include "padding.cuh"
#include "warp_scan.cuh"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;  // 8 rays per block

template <typename scalar_t>
struct Sums {
  scalar_t weight, moment, loss;  // W, M (sums of w and w m) and L_b, the same in every lane
};

// One pass of a warp over its ray's samples: the ray's totals; when `totals` is given (the backward's second
// pass), each sample's gradient g dL_b/ds_i is also written to g_sd.
template <typename scalar_t>
__device__ Sums<scalar_t> ray_pass(const scalar_t* __restrict__ sd, const scalar_t* __restrict__ t0,
                                   const scalar_t* __restrict__ t1, RayRange range, int lane,
                                   const Sums<scalar_t>* totals, scalar_t g, scalar_t* __restrict__ g_sd) {
  scalar_t optical = 0, weight = 0, moment = 0, loss = 0, prefix = 0;  // the chunks before (warp-uniform)
  const bool any = range.first < range.last;
  const scalar_t a0 = any ? t0[range.first] : scalar_t(0), z0 = any ? t1[range.first] : scalar_t(0);
  for (int64_t base = range.first; base < range.last; base += kWarp) {
    const int64_t i = base + lane;
    const bool valid = i < range.last;
    const scalar_t s = valid ? sd[i] : scalar_t(0), a = valid ? t0[i] : scalar_t(0), z = valid ? t1[i] : scalar_t(0);
    const scalar_t m = ((a - a0) + (z - z0)) / 2, d = z - a;  // midpoints from the ray's first (distortion.h)
    const scalar_t inclusive = warp_inclusive_scan(s, lane);
    const scalar_t transmittance = exp_of(-(optical + warp_exclusive_from(inclusive, lane)));
    const scalar_t w = valid ? -transmittance * expm1_of(-s) : scalar_t(0);
    const scalar_t w_inclusive = warp_inclusive_scan(w, lane), wm_inclusive = warp_inclusive_scan(w * m, lane);
    const scalar_t w_before = weight + warp_exclusive_from(w_inclusive, lane);   // W_i
    const scalar_t m_before = moment + warp_exclusive_from(wm_inclusive, lane);  // M_i
    const scalar_t pairs = m * w_before - m_before;
    loss += 2 * w * pairs + w * w * d / 3;  // per lane; summed over the warp at the end
    if (totals != nullptr) {
      const scalar_t w_after = totals->weight - w_before - w, m_after = totals->moment - m_before - w * m;
      const scalar_t grad_w = 2 * pairs + 2 * (m_after - m * w_after) + 2 * w * d / 3;
      const scalar_t running = prefix + warp_inclusive_scan(w * grad_w, lane);
      if (valid) g_sd[i] = g * ((transmittance - w) * grad_w - (2 * totals->loss - running));
      prefix = __shfl_sync(kAll, running, kWarp - 1);
    }
    optical += __shfl_sync(kAll, inclusive, kWarp - 1);
    weight += __shfl_sync(kAll, w_inclusive, kWarp - 1);
    moment += __shfl_sync(kAll, wm_inclusive, kWarp - 1);
  }
  return {weight, moment, warp_sum(loss)};
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    distortion_forward_kernel(const scalar_t* __restrict__ sd, const scalar_t* __restrict__ t0,
                              const scalar_t* __restrict__ t1, const int64_t* __restrict__ offsets, int64_t rays,
                              int64_t n, scalar_t* __restrict__ loss) {
  const int lane = threadIdx.x % kWarp;
  const int64_t b = int64_t(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
  if (b >= rays) return;  // whole warps leave together
  const Sums<scalar_t> sums = ray_pass<scalar_t>(sd, t0, t1, ray_range(offsets, b, n), lane, nullptr, 0, nullptr);
  if (lane == 0) loss[b] = sums.loss;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    distortion_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ sd,
                               const scalar_t* __restrict__ t0, const scalar_t* __restrict__ t1,
                               const int64_t* __restrict__ offsets, int64_t rays, int64_t n,
                               scalar_t* __restrict__ g_sd) {
  const int lane = threadIdx.x % kWarp;
  const int64_t b = int64_t(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
  if (b >= rays) return;
  const RayRange range = ray_range(offsets, b, n);
  const Sums<scalar_t> totals = ray_pass<scalar_t>(sd, t0, t1, range, lane, nullptr, 0, nullptr);
  ray_pass<scalar_t>(sd, t0, t1, range, lane, &totals, grad[b], g_sd);
  // samples before the first ray (offsets not starting at 0: invalid, not checked on CUDA) get zero; consecutive
  // ranges leave no gaps; the rows after the last ray (padding) are zeroed by the grid afterwards (zero_rows_from)
  if (b == 0)
    for (int64_t i = lane; i < min(range.first, n); i += kWarp) g_sd[i] = 0;
}

}  // namespace

at::Tensor distortion_loss_cuda(const at::Tensor& optical_depth_in, const at::Tensor& t_start_in,
                                const at::Tensor& t_end_in, const at::Tensor& ray_offsets_in) {
  const char* op = "distortion_loss";
  check_distortion_inputs(optical_depth_in, t_start_in, t_end_in, ray_offsets_in, at::kCUDA, op);
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), t0 = t_start_in.contiguous(), t1 = t_end_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous();
  const int64_t rays = offsets.size(0) - 1;
  at::Tensor loss = at::empty({rays}, sd.options());
  if (rays == 0) return loss;
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "distortion_loss_cuda", [&] {
    distortion_forward_kernel<scalar_t>
        <<<block_count(rays * kWarp, kThreads, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            sd.const_data_ptr<scalar_t>(), t0.const_data_ptr<scalar_t>(), t1.const_data_ptr<scalar_t>(),
            offsets.const_data_ptr<int64_t>(), rays, sd.size(0), loss.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return loss;
}

at::Tensor distortion_loss_backward_cuda(const at::Tensor& grad_in, const at::Tensor& optical_depth_in,
                                         const at::Tensor& t_start_in, const at::Tensor& t_end_in,
                                         const at::Tensor& ray_offsets_in) {
  const char* op = "distortion_loss_backward";
  check_distortion_inputs(optical_depth_in, t_start_in, t_end_in, ray_offsets_in, at::kCUDA, op);
  const int64_t rays = ray_offsets_in.size(0) - 1;
  check_distortion_grad(grad_in, optical_depth_in, rays, op);
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), t0 = t_start_in.contiguous(), t1 = t_end_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous(), grad = grad_in.contiguous();
  if (rays == 0) return at::zeros_like(sd);
  at::Tensor g_sd = at::empty_like(sd);  // every sample before the last offset is written (distortion_backward_kernel)
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "distortion_loss_backward_cuda", [&] {
    distortion_backward_kernel<scalar_t>
        <<<block_count(rays * kWarp, kThreads, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            grad.const_data_ptr<scalar_t>(), sd.const_data_ptr<scalar_t>(), t0.const_data_ptr<scalar_t>(),
            t1.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), rays, sd.size(0),
            g_sd.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    zero_rows_from<scalar_t>(g_sd, offsets.const_data_ptr<int64_t>() + rays);  // the padding past the last offset
  });
  return g_sd;
}

}  // namespace cuda_ext
