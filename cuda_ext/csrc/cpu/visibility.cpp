// visible_samples and visible_samples_capped on the CPU: one task per range of rays (at::parallel_for) counts each
// ray's alive and shown samples, a serial scan turns the counts into offsets, and a second pass writes each ray's
// entries at its offsets (visibility.h has the rule and the capped outputs' contract).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "ops.h"
#include "render.h"
#include "visibility.h"

namespace cuda_ext {
namespace {

constexpr int64_t kRayGrain = 256;  // rays per task

// Walks ray b's samples in order, calling visit(i, shown) for each alive one while it returns true; returns when
// the ray ends, its first dead sample comes (every later one is dead too) or visit declines.
template <typename scalar_t, typename Visit>
void walk_ray(const scalar_t* sd, const int64_t* offsets, const scalar_t* start, int64_t n, int64_t b, scalar_t limit,
              scalar_t threshold, Visit&& visit) {
  const int64_t first = std::max<int64_t>(offsets[b], 0), last = std::min<int64_t>(offsets[b + 1], n);
  double before = start ? static_cast<double>(start[b]) : 0.0;  // the start, then the earlier samples' clamped sum
  for (int64_t i = first; i < last; ++i) {
    const scalar_t above = static_cast<scalar_t>(before);
    if (!(above < limit)) return;
    const scalar_t w = std::exp(-above) * -std::expm1(-sd[i]);
    if (!visit(i, w > threshold)) return;
    before += std::fmin(static_cast<double>(sd[i]), kOpaqueDepth);
  }
}

// Both ops: capacity absent, the outputs have the counts' sizes; given, they have its sizes (visibility.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> visible_packed_cpu(
    const at::Tensor& optical_depth_in, const at::Tensor& ray_offsets_in, double early_termination,
    double weight_threshold, const std::optional<at::Tensor>& start_in, std::optional<VisibleCapacity> capacity) {
  check_visibility_inputs(optical_depth_in, ray_offsets_in, early_termination, weight_threshold, start_in, at::kCPU);
  if (capacity) check_visible_capacity(*capacity);
  const at::Tensor sd = optical_depth_in.contiguous(), offsets = ray_offsets_in.contiguous();
  const at::Tensor start_depth = start_in ? start_in->contiguous() : at::Tensor();
  check_render_offsets(offsets, sd.size(0), capacity ? "visible_samples_capped" : "visible_samples");
  const int64_t rays = offsets.size(0) - 1, n = sd.size(0);
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  // alive[b + 1], shown[b + 1]: ray b's counts, then (scanned) where its entries start and end
  std::vector<int64_t> alive(rays + 1, 0), shown(rays + 1, 0);
  at::Tensor index, keep, totals;
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "visible_samples_cpu", [&] {
    const scalar_t* s = sd.const_data_ptr<scalar_t>();
    const scalar_t* start = start_depth.defined() ? start_depth.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t limit = alive_limit<scalar_t>(early_termination);
    const scalar_t threshold = static_cast<scalar_t>(weight_threshold);
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        walk_ray<scalar_t>(s, o, start, n, b, limit, threshold, [&](int64_t, bool show) {
          ++alive[b + 1];
          shown[b + 1] += show;
          return true;
        });
      }
    });
    for (int64_t b = 0; b < rays; ++b) {
      alive[b + 1] += alive[b];
      shown[b + 1] += shown[b];
    }
    totals = at::tensor({alive[rays], shown[rays]}, offsets.options());
    const int64_t alive_size = capacity ? capacity->alive : alive[rays];
    const int64_t shown_size = capacity ? capacity->shown : shown[rays];
    for (auto& offset : alive) offset = std::min(offset, alive_size);  // capped: a ray past the room cut short
    std::tie(index, keep) = visible_outputs(alive_size, shown_size, n, capacity.has_value(), offsets.options());
    int64_t* index_out = index.data_ptr<int64_t>();
    int64_t* keep_out = keep.data_ptr<int64_t>();
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        int64_t a = alive[b], k = shown[b];
        const int64_t stop = alive[b + 1];
        if (a >= stop) continue;
        walk_ray<scalar_t>(s, o, start, n, b, limit, threshold, [&](int64_t i, bool show) {
          if (show && k < shown_size) keep_out[k] = a;
          k += show;
          index_out[a++] = i;
          return a < stop;
        });
      }
    });
  });
  return {index, keep, at::tensor(alive, offsets.options()), totals};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> visible_samples_cpu(const at::Tensor& optical_depth,
                                                                   const at::Tensor& ray_offsets,
                                                                   double early_termination, double weight_threshold,
                                                                   const std::optional<at::Tensor>& start_depth) {
  auto [index, keep, offsets, totals] =
      visible_packed_cpu(optical_depth, ray_offsets, early_termination, weight_threshold, start_depth, std::nullopt);
  return {index, keep, offsets};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> visible_samples_capped_cpu(
    const at::Tensor& optical_depth, const at::Tensor& ray_offsets, double early_termination, double weight_threshold,
    int64_t alive_capacity, int64_t shown_capacity, const std::optional<at::Tensor>& start_depth) {
  return visible_packed_cpu(optical_depth, ray_offsets, early_termination, weight_threshold, start_depth,
                            VisibleCapacity{alive_capacity, shown_capacity});
}

}  // namespace cuda_ext
