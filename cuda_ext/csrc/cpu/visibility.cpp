// visible_samples on the CPU: one task per range of rays (at::parallel_for) counts each ray's alive and shown
// samples, a serial scan turns the counts into offsets, and a second pass writes each ray's entries at its
// offsets (visibility.h has the rule).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "render.h"
#include "visibility.h"

namespace cuda_ext {
namespace {

constexpr int64_t kRayGrain = 256;  // rays per task

// Walks ray b's samples in order, calling visit(i, shown) for each alive one; returns when the ray ends or its
// first dead sample comes (every later one is dead too).
template <typename scalar_t, typename Visit>
void walk_ray(const scalar_t* sd, const int64_t* offsets, int64_t n, int64_t b, scalar_t limit, scalar_t threshold,
              Visit&& visit) {
  const int64_t first = std::max<int64_t>(offsets[b], 0), last = std::min<int64_t>(offsets[b + 1], n);
  double before = 0.0;  // sum of the clamped optical depths of the earlier samples
  for (int64_t i = first; i < last; ++i) {
    const scalar_t above = static_cast<scalar_t>(before);
    if (!(above < limit)) return;
    const scalar_t w = std::exp(-above) * -std::expm1(-sd[i]);
    visit(i, w > threshold);
    before += std::fmin(static_cast<double>(sd[i]), kOpaqueDepth);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> visible_samples_cpu(const at::Tensor& optical_depth_in,
                                                                   const at::Tensor& ray_offsets_in,
                                                                   double early_termination, double weight_threshold) {
  check_visibility_inputs(optical_depth_in, ray_offsets_in, early_termination, weight_threshold, at::kCPU);
  const at::Tensor sd = optical_depth_in.contiguous(), offsets = ray_offsets_in.contiguous();
  check_render_offsets(offsets, sd.size(0), "visible_samples");
  const int64_t rays = offsets.size(0) - 1, n = sd.size(0);
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  // alive[b + 1], shown[b + 1]: ray b's counts, then (scanned) where its entries start and end
  std::vector<int64_t> alive(rays + 1, 0), shown(rays + 1, 0);
  at::Tensor index, keep;
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "visible_samples_cpu", [&] {
    const scalar_t* s = sd.const_data_ptr<scalar_t>();
    const scalar_t limit = alive_limit<scalar_t>(early_termination);
    const scalar_t threshold = static_cast<scalar_t>(weight_threshold);
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        walk_ray<scalar_t>(s, o, n, b, limit, threshold, [&](int64_t, bool show) {
          ++alive[b + 1];
          shown[b + 1] += show;
        });
      }
    });
    for (int64_t b = 0; b < rays; ++b) {
      alive[b + 1] += alive[b];
      shown[b + 1] += shown[b];
    }
    index = at::empty({alive[rays]}, offsets.options());
    keep = at::empty({shown[rays]}, offsets.options());
    int64_t* index_out = index.data_ptr<int64_t>();
    int64_t* keep_out = keep.data_ptr<int64_t>();
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        int64_t a = alive[b], k = shown[b];
        walk_ray<scalar_t>(s, o, n, b, limit, threshold, [&](int64_t i, bool show) {
          if (show) keep_out[k++] = a;
          index_out[a++] = i;
        });
      }
    });
  });
  return {index, keep, at::tensor(alive, offsets.options())};
}

}  // namespace cuda_ext
