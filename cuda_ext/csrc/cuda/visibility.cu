// visible_samples on CUDA: one warp per ray, two passes (visibility.h has the rule).
//
// Each pass walks the ray in chunks of 32 consecutive samples, one per lane, as volume_render does: a warp scan
// of the clamped optical depths (in float64, as the reference's sums) gives each lane the depth before it. A ray's
// alive samples are those before its first dead one, so a chunk's alive lanes are its first ones; a ballot counts
// them and the shown ones (first pass) and, through the lanes below, gives each shown sample its slot (second
// pass). The ray stops at the first chunk that ends it or holds a dead sample. Between the passes an inclusive sum
// of the counts gives the offsets, and one device-to-host copy of the two totals sizes the outputs (the op's one
// sync).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ops.h"
#include "visibility.h"
#include "warp_scan.cuh"

namespace cuda_ext {
namespace {

constexpr int kBlockThreads = 256;  // 8 rays per block

// kWrite false: alive[b], shown[b] = ray b's counts. kWrite true: ray b's alive samples at index[alive[b]...]
// and the positions of its shown ones at keep[shown[b]...] (alive and shown then hold the scanned offsets).
template <typename scalar_t, bool kWrite>
__global__ void __launch_bounds__(kBlockThreads)
    visibility_kernel(const scalar_t* __restrict__ sd, const int64_t* __restrict__ offsets, int64_t rays, int64_t n,
                      scalar_t limit, scalar_t threshold, int64_t* __restrict__ alive, int64_t* __restrict__ shown,
                      int64_t* __restrict__ index, int64_t* __restrict__ keep) {
  const int lane = threadIdx.x % kWarp;
  const int64_t b = (int64_t(blockIdx.x) * kBlockThreads + threadIdx.x) / kWarp;
  if (b >= rays) return;  // whole warps leave together
  const RayRange range = ray_range(offsets, b, n);
  int64_t a = kWrite ? alive[b] : 0, k = kWrite ? shown[b] : 0;
  double carry = 0.0;  // the clamped optical depth of the chunks before
  for (int64_t base = range.first; base < range.last; base += kWarp) {
    const int64_t i = base + lane;
    const bool valid = i < range.last;
    const scalar_t s = valid ? sd[i] : scalar_t(0);
    const double inclusive = warp_inclusive_scan(valid ? fmin(double(s), kOpaqueDepth) : 0.0, lane);
    const scalar_t above = static_cast<scalar_t>(carry + warp_exclusive_from(inclusive, lane));
    // the lanes before the first dead one: the scan's tree sums can step back by an ulp where a term is ~0, so a
    // lane past a dead one could test alive again; the ray ends at its first dead sample, as in the CPU loop
    const unsigned dead_lanes = __ballot_sync(kAll, !(valid && above < limit));
    const unsigned alive_lanes = dead_lanes ? (1u << (__ffs(dead_lanes) - 1)) - 1u : kAll;
    const bool is_alive = (alive_lanes >> lane) & 1u;
    const bool is_shown = is_alive && exp_of(-above) * -expm1_of(-s) > threshold;
    const unsigned shown_lanes = __ballot_sync(kAll, is_shown);
    if (kWrite) {
      if (is_alive) index[a + lane] = i;  // the alive lanes are the chunk's first
      if (is_shown) keep[k + __popc(shown_lanes & ((1u << lane) - 1u))] = a + lane;
    }
    a += __popc(alive_lanes);
    k += __popc(shown_lanes);
    if (dead_lanes) break;  // the ray ended in this chunk, or a sample died: the rest is dead
    carry += __shfl_sync(kAll, inclusive, kWarp - 1);
  }
  if (!kWrite && lane == 0) {
    alive[b] = a;
    shown[b] = k;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> visible_samples_cuda(const at::Tensor& optical_depth_in,
                                                                    const at::Tensor& ray_offsets_in,
                                                                    double early_termination, double weight_threshold) {
  check_visibility_inputs(optical_depth_in, ray_offsets_in, early_termination, weight_threshold, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), offsets = ray_offsets_in.contiguous();
  const int64_t rays = offsets.size(0) - 1, n = sd.size(0);
  // row 0: the alive counts, row 1: the shown counts, at [1, B]; scanned in place into offsets
  at::Tensor counts = at::zeros({2, rays + 1}, offsets.options());
  at::Tensor index, keep;
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "visible_samples_cuda", [&] {
    const scalar_t limit = alive_limit<scalar_t>(early_termination);
    const scalar_t threshold = static_cast<scalar_t>(weight_threshold);
    const unsigned int blocks = block_count(rays * kWarp, kBlockThreads, "visible_samples");
    const auto stream = c10::cuda::getCurrentCUDAStream();
    int64_t* alive = counts.data_ptr<int64_t>();
    int64_t* shown = alive + rays + 1;
    if (rays > 0) {
      visibility_kernel<scalar_t, false>
          <<<blocks, kBlockThreads, 0, stream>>>(sd.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), rays,
                                                 n, limit, threshold, alive + 1, shown + 1, nullptr, nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      for (int row = 0; row < 2; ++row) counts[row].narrow(0, 1, rays).cumsum_(0);
    }
    const at::Tensor totals = counts.select(1, rays).cpu();  // the sync: the outputs' sizes
    index = at::empty({totals[0].item<int64_t>()}, offsets.options());
    keep = at::empty({totals[1].item<int64_t>()}, offsets.options());
    if (index.numel() > 0) {
      visibility_kernel<scalar_t, true><<<blocks, kBlockThreads, 0, stream>>>(
          sd.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), rays, n, limit, threshold, alive, shown,
          index.data_ptr<int64_t>(), keep.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {index, keep, counts[0].clone()};
}

}  // namespace cuda_ext
