// visible_samples and visible_samples_capped on CUDA: one warp per ray, two passes (visibility.h has the rule and
// the capped outputs' contract).
//
// Each pass walks the ray in chunks of 32 consecutive samples, one per lane, as volume_render does: a warp scan
// of the clamped optical depths (in float64, as the reference's sums) gives each lane the depth before it. A ray's
// alive samples are those before its first dead one, so a chunk's alive lanes are its first ones; a ballot counts
// them and the shown ones (first pass) and, through the lanes below, gives each shown sample its slot (second
// pass). The ray stops at the first chunk that ends it or holds a dead sample. Between the passes an inclusive sum
// of the counts gives the offsets, and one device-to-host copy of the two totals sizes the outputs (the op's one
// sync). The capped op skips that copy: its sizes are given, its alive offsets clamped to them on the device, and
// the write pass stops each ray at its clamped end (and writes no keep slot past the shown capacity).
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>

#include "ops.h"
#include "visibility.h"
#include "warp_scan.cuh"

namespace cuda_ext {
namespace {

constexpr int kBlockThreads = 256;  // 8 rays per block

// kWrite false: alive[b], shown[b] = ray b's counts. kWrite true: ray b's alive samples at index[alive[b]...]
// up to alive[b + 1], and the positions of its shown ones at keep[shown[b]...] below shown_size (alive and shown
// then hold the scanned offsets, alive clamped to the capacity when capped).
template <typename scalar_t, bool kWrite>
__global__ void __launch_bounds__(kBlockThreads)
    visibility_kernel(const scalar_t* __restrict__ sd, const int64_t* __restrict__ offsets,
                      const scalar_t* __restrict__ start, int64_t rays, int64_t n, scalar_t limit, scalar_t threshold,
                      int64_t* __restrict__ alive, int64_t* __restrict__ shown, int64_t* __restrict__ index,
                      int64_t* __restrict__ keep, int64_t shown_size) {
  const int lane = threadIdx.x % kWarp;
  const int64_t b = (int64_t(blockIdx.x) * kBlockThreads + threadIdx.x) / kWarp;
  if (b >= rays) return;  // whole warps leave together
  const RayRange range = ray_range(offsets, b, n);
  int64_t a = kWrite ? alive[b] : 0, k = kWrite ? shown[b] : 0;
  const int64_t stop = kWrite ? alive[b + 1] : 0;  // the ray's room in index
  if (kWrite && a >= stop) return;
  double carry = start ? double(start[b]) : 0.0;  // the start, then the clamped optical depth of the chunks before
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
    if (kWrite && is_alive && a + lane < stop) {  // the alive lanes are the chunk's first
      index[a + lane] = i;
      const int64_t slot = k + __popc(shown_lanes & ((1u << lane) - 1u));
      if (is_shown && slot < shown_size) keep[slot] = a + lane;
    }
    a += __popc(alive_lanes);
    k += __popc(shown_lanes);
    if (dead_lanes || (kWrite && a >= stop)) break;  // the ray ended or ran out of room, or a sample died
    carry += __shfl_sync(kAll, inclusive, kWarp - 1);
  }
  if (!kWrite && lane == 0) {
    alive[b] = a;
    shown[b] = k;
  }
}

}  // namespace

namespace {

// Both ops (as visible_packed_cpu): capacity absent, one sync sizes the outputs; given, they have its sizes.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> visible_packed_cuda(
    const at::Tensor& optical_depth_in, const at::Tensor& ray_offsets_in, double early_termination,
    double weight_threshold, const std::optional<at::Tensor>& start_in, std::optional<VisibleCapacity> capacity) {
  check_visibility_inputs(optical_depth_in, ray_offsets_in, early_termination, weight_threshold, start_in, at::kCUDA);
  if (capacity) check_visible_capacity(*capacity);
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), offsets = ray_offsets_in.contiguous();
  const at::Tensor start_depth = start_in ? start_in->contiguous() : at::Tensor();
  const int64_t rays = offsets.size(0) - 1, n = sd.size(0);
  // row 0: the alive counts, row 1: the shown counts, at [1, B]; scanned in place into offsets
  at::Tensor counts = at::zeros({2, rays + 1}, offsets.options());
  at::Tensor index, keep, totals;
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "visible_samples_cuda", [&] {
    const scalar_t limit = alive_limit<scalar_t>(early_termination);
    const scalar_t threshold = static_cast<scalar_t>(weight_threshold);
    const unsigned int blocks = block_count(rays * kWarp, kBlockThreads, "visible_samples");
    const auto stream = c10::cuda::getCurrentCUDAStream();
    int64_t* alive = counts.data_ptr<int64_t>();
    int64_t* shown = alive + rays + 1;
    const scalar_t* start = start_depth.defined() ? start_depth.const_data_ptr<scalar_t>() : nullptr;
    if (rays > 0) {
      visibility_kernel<scalar_t, false><<<blocks, kBlockThreads, 0, stream>>>(
          sd.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), start, rays, n, limit, threshold, alive + 1,
          shown + 1, nullptr, nullptr, 0);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      for (int row = 0; row < 2; ++row) counts[row].narrow(0, 1, rays).cumsum_(0);
    }
    totals = counts.select(1, rays);  // A and K, on the device
    int64_t alive_size = 0, shown_size = 0;
    if (capacity) {
      totals = totals.clone();  // the clamp below writes into counts' last column
      alive_size = capacity->alive;
      shown_size = capacity->shown;
      counts[0].clamp_max_(alive_size);
    } else {
      const at::Tensor sizes = totals.cpu();  // the sync: the outputs' sizes
      alive_size = sizes[0].item<int64_t>();
      shown_size = sizes[1].item<int64_t>();
    }
    std::tie(index, keep) = visible_outputs(alive_size, shown_size, n, capacity.has_value(), offsets.options());
    if (alive_size > 0 && rays > 0) {
      visibility_kernel<scalar_t, true><<<blocks, kBlockThreads, 0, stream>>>(
          sd.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), start, rays, n, limit, threshold, alive,
          shown, index.data_ptr<int64_t>(), keep.data_ptr<int64_t>(), shown_size);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {index, keep, counts[0].clone(), totals};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> visible_samples_cuda(const at::Tensor& optical_depth,
                                                                    const at::Tensor& ray_offsets,
                                                                    double early_termination, double weight_threshold,
                                                                    const std::optional<at::Tensor>& start_depth) {
  auto [index, keep, offsets, totals] =
      visible_packed_cuda(optical_depth, ray_offsets, early_termination, weight_threshold, start_depth, std::nullopt);
  return {index, keep, offsets};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> visible_samples_capped_cuda(
    const at::Tensor& optical_depth, const at::Tensor& ray_offsets, double early_termination, double weight_threshold,
    int64_t alive_capacity, int64_t shown_capacity, const std::optional<at::Tensor>& start_depth) {
  return visible_packed_cuda(optical_depth, ray_offsets, early_termination, weight_threshold, start_depth,
                             VisibleCapacity{alive_capacity, shown_capacity});
}

}  // namespace cuda_ext
