// march_rays and march_rays_capped on CUDA: one warp per ray, two passes (march.h has the sample math).
//
// Each pass walks the ray in chunks of 32 consecutive samples, one per lane: a ballot of the kept samples
// gives the chunk's count (first pass) and, through the lanes below, each kept sample's slot (second pass),
// so the samples come out in order along the ray with no atomics, and 32 lanes write 32 neighbouring slots.
// A ray stops at the first chunk holding a sample where it ends (t >= t_end, or past infinity in the contracted
// space); lanes after the first such sample keep nothing, as the CPU loop stops there. Between the passes an inclusive
// sum of the counts gives the ray offsets, and one device-to-host copy of the total sizes the outputs (the op's only
// sync, where nonzero() on a dense (B, S) mask had one too). march_rays_capped has no sync: its outputs have the
// size it is given, the offsets are clamped to it on the device, and the write pass stops at each ray's clamped end.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <type_traits>

#include "march.h"
#include "ops.h"

namespace cuda_ext {
namespace {

constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;
constexpr unsigned kAll = 0xffffffffu;

struct GridShape {
  int64_t cells[3];
};

template <typename scalar_t>
struct MarchArgs {
  const scalar_t *origins, *directions, *t_start, *t_end, *offset, *box, *t_split;  // t_split null: bounded
  const unsigned char* occupied;  // bool cells, read as bytes (__ldg has no bool overload)
  GridShape shape;
  scalar_t step;
  int64_t max_samples, rays;
  int64_t slab_first, slab_end;  // the first-axis cells a sample may be kept in (kSlab kernels)
};

// kWrite false: counts[b] = ray b's kept samples. kWrite true: its samples at [offsets[b], offsets[b + 1]) (the
// offsets clamped to a capacity cut an overflowing ray short: its samples past offsets[b + 1] are not written).
// kSlab: samples kept only in the first-axis cells [slab_first, slab_end), each ray walked only near them. Its own
// instance: the slab's span and cell test cost registers (70 against 58 for the float write pass: 3 blocks an SM
// instead of 4) that made the plain march ~15% slower on an H200 when they were one kernel.
template <typename scalar_t, bool kWrite, bool kSlab>
__global__ void __launch_bounds__(kBlockThreads) march_kernel(MarchArgs<scalar_t> args, int64_t* counts_or_offsets,
                                                              int64_t* out_ray, scalar_t* out_t, scalar_t* out_points) {
  const int64_t b = (static_cast<int64_t>(blockIdx.x) * kBlockThreads + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (b >= args.rays) return;  // b is the same for the whole warp
  MarchRay<scalar_t> ray(args.origins + 3 * b, args.directions + 3 * b, args.box, args.shape.cells, args.t_start[b],
                         args.t_end[b], args.offset[b], args.step);
  if (args.t_split != nullptr) ray.contract_at(args.t_split[b], args.box, args.max_samples);
  int64_t slot = kWrite ? counts_or_offsets[b] : 0;
  const int64_t stop = kWrite ? counts_or_offsets[b + 1] : 0;
  int64_t walk_first = 0, walk_end = args.max_samples;
  if (kSlab) ray.slab_span(args.slab_first, args.slab_end, args.max_samples, &walk_first, &walk_end);
  for (int64_t first = walk_first; first < walk_end; first += kWarp) {
    const int64_t k = first + lane;
    scalar_t t;
    const bool inside = k < walk_end && ray.sample(k, &t);  // past walk_end: no sample of the slab, as if ended
    const unsigned outside_lanes = __ballot_sync(kAll, !inside);
    // the ray ends at the first lane outside: the lanes below it are the chunk's live samples
    const unsigned live_lanes = outside_lanes ? (1u << (__ffs(outside_lanes) - 1)) - 1u : kAll;
    scalar_t unit[3];
    bool kept = false;
    if ((live_lanes >> lane) & 1u) {
      int64_t cell = 0;
      const int64_t index = ray.locate(t, unit, kSlab ? &cell : nullptr);
      kept = (!kSlab || (cell >= args.slab_first && cell < args.slab_end)) && __ldg(args.occupied + index) != 0;
    }
    const unsigned kept_lanes = __ballot_sync(kAll, kept);
    const int64_t i = slot + __popc(kept_lanes & ((1u << lane) - 1u));
    if (kWrite && kept && i < stop) {
      out_ray[i] = b;
      out_t[i] = t;
#pragma unroll
      for (int a = 0; a < 3; ++a) out_points[3 * i + a] = unit[a];
    }
    slot += __popc(kept_lanes);
    if (outside_lanes != 0 || (kWrite && slot >= stop)) break;  // the rest of the ray is past its end (or its room)
  }
  if (!kWrite && lane == 0) counts_or_offsets[b] = slot;
}

// Both ops (as march_packed_cpu): capacity absent, one sync sizes the outputs (and no total: march_rays drops it);
// given, they have that size and the last output is the (1,) true total, on the device.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_packed_cuda(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    const std::optional<at::Tensor>& t_split, std::optional<int64_t> capacity, const at::OptionalIntArrayRef& slab) {
  check_march_inputs(origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split,
                     at::kCUDA);
  check_march_slab(slab, occupancy);
  if (capacity) check_march_capacity(*capacity);
  const c10::cuda::CUDAGuard device_guard(origins.device());
  const auto o = origins.contiguous(), d = directions.contiguous(), t0 = t_start.contiguous(), t1 = t_end.contiguous(),
             off = offset.contiguous(), grid = occupancy.contiguous(), bx = box.contiguous();
  const at::Tensor split = t_split ? t_split->contiguous() : at::Tensor();
  const int64_t rays = o.size(0);
  at::Tensor ray_offsets = at::zeros({rays + 1}, o.options().dtype(at::kLong));
  at::Tensor ray_index, t, points, total;
  AT_DISPATCH_FLOATING_TYPES(o.scalar_type(), "march_rays_cuda", [&] {
    MarchArgs<scalar_t> args{o.const_data_ptr<scalar_t>(),
                             d.const_data_ptr<scalar_t>(),
                             t0.const_data_ptr<scalar_t>(),
                             t1.const_data_ptr<scalar_t>(),
                             off.const_data_ptr<scalar_t>(),
                             bx.const_data_ptr<scalar_t>(),
                             split.defined() ? split.const_data_ptr<scalar_t>() : nullptr,
                             reinterpret_cast<const unsigned char*>(grid.const_data_ptr<bool>()),
                             GridShape{{grid.size(0), grid.size(1), grid.size(2)}},
                             static_cast<scalar_t>(step),
                             max_samples,
                             rays,
                             slab ? (*slab)[0] : 0,
                             slab ? (*slab)[1] : grid.size(0)};
    const int64_t blocks = (rays * kWarp + kBlockThreads - 1) / kBlockThreads;
    const auto stream = c10::cuda::getCurrentCUDAStream();
    // the pass's kernel, kWrite given, kSlab as the call: with or without the slab's span and cell test
    auto pass = [&](auto write) {
      return slab ? march_kernel<scalar_t, decltype(write)::value, true>
                  : march_kernel<scalar_t, decltype(write)::value, false>;
    };
    if (rays > 0) {
      pass(std::false_type{})<<<blocks, kBlockThreads, 0, stream>>>(args, ray_offsets.data_ptr<int64_t>() + 1, nullptr,
                                                                    nullptr, nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      ray_offsets.narrow(0, 1, rays).cumsum_(0);
    }
    int64_t size = 0;
    if (capacity) {
      total = ray_offsets.narrow(0, rays, 1).clone();  // the true count, on the device, before the clamp
      size = *capacity;
      ray_offsets.clamp_max_(size);
    } else {
      size = ray_offsets[rays].item<int64_t>();  // the sync: the outputs' size
    }
    std::tie(ray_index, t, points) = march_outputs(size, rays, capacity.has_value(), o.options());
    if (size > 0 && rays > 0) {
      pass(std::true_type{})<<<blocks, kBlockThreads, 0, stream>>>(args, ray_offsets.data_ptr<int64_t>(),
                                                                   ray_index.data_ptr<int64_t>(),
                                                                   t.data_ptr<scalar_t>(), points.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {ray_index, t, points, ray_offsets, total};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_cuda(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab) {
  auto [ray, t, points, ray_offsets, total] = march_packed_cuda(origins, directions, t_start, t_end, offset, occupancy,
                                                                box, step, max_samples, t_split, std::nullopt, slab);
  return {ray, t, points, ray_offsets};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_capped_cuda(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    int64_t capacity, const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab) {
  return march_packed_cuda(origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split,
                           capacity, slab);
}

}  // namespace cuda_ext
