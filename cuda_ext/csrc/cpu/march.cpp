// march_rays and march_rays_capped on the CPU: two passes over the rays (at::parallel_for), the first counting
// each ray's kept samples, the second writing them at the ray's offset (march.h has the sample math).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "march.h"
#include "ops.h"

namespace cuda_ext {
namespace {

constexpr int64_t kRayGrain = 64;  // rays per task: a ray is up to max_samples lookups

// The op's per-ray inputs, read-only; split is null for the bounded case.
template <typename scalar_t>
struct RayInputs {
  const scalar_t *o, *d, *t0, *t1, *off, *box, *split;
  const int64_t* shape;
  scalar_t step;
  int64_t max_samples;
  int64_t slab_first, slab_end;  // the first-axis cells a sample may be kept in; clip: walk only near them
  bool clip;

  MarchRay<scalar_t> at(int64_t b) const {
    MarchRay<scalar_t> ray(o + 3 * b, d + 3 * b, box, shape, t0[b], t1[b], off[b], step);
    if (split != nullptr) ray.contract_at(split[b], box, max_samples);
    return ray;
  }

  // Calls emit(t, unit) for each kept sample of ray b, in order; stops at the first sample where the ray ends.
  template <typename Emit>
  void for_each_kept(int64_t b, const bool* occupied, Emit&& emit) const {
    const MarchRay<scalar_t> ray = at(b);
    int64_t first = 0, end = max_samples, cell = 0;
    if (clip) ray.slab_span(slab_first, slab_end, max_samples, &first, &end);
    scalar_t unit[3], t;
    for (int64_t k = first; k < end; ++k) {
      if (!ray.sample(k, &t)) break;
      const int64_t index = ray.locate(t, unit, &cell);
      if (cell >= slab_first && cell < slab_end && occupied[index]) emit(t, unit);
    }
  }
};

// Both ops: capacity absent, outputs of the samples' count (march_rays); given, of that size with the first
// `capacity` samples, the ray offsets clamped to it and the other slots padding (march_rays_capped). The last
// output is (1,) int64, the samples' true total.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_packed_cpu(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    const std::optional<at::Tensor>& t_split, std::optional<int64_t> capacity, const at::OptionalIntArrayRef& slab) {
  check_march_inputs(origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split, at::kCPU);
  check_march_slab(slab, occupancy);
  if (capacity) check_march_capacity(*capacity);
  const auto o = origins.contiguous(), d = directions.contiguous(), t0 = t_start.contiguous(), t1 = t_end.contiguous(),
             off = offset.contiguous(), grid = occupancy.contiguous(), bx = box.contiguous();
  const at::Tensor split = t_split ? t_split->contiguous() : at::Tensor();
  const int64_t rays = o.size(0);
  const int64_t shape[3] = {grid.size(0), grid.size(1), grid.size(2)};
  const bool* occupied = grid.const_data_ptr<bool>();
  at::Tensor ray_offsets = at::zeros({rays + 1}, o.options().dtype(at::kLong));
  at::Tensor ray_index, t, points, total;
  AT_DISPATCH_FLOATING_TYPES(o.scalar_type(), "march_rays_cpu", [&] {
    const RayInputs<scalar_t> in{o.const_data_ptr<scalar_t>(),
                                 d.const_data_ptr<scalar_t>(),
                                 t0.const_data_ptr<scalar_t>(),
                                 t1.const_data_ptr<scalar_t>(),
                                 off.const_data_ptr<scalar_t>(),
                                 bx.const_data_ptr<scalar_t>(),
                                 split.defined() ? split.const_data_ptr<scalar_t>() : nullptr,
                                 shape,
                                 static_cast<scalar_t>(step),
                                 max_samples,
                                 slab ? (*slab)[0] : 0,
                                 slab ? (*slab)[1] : shape[0],
                                 slab.has_value()};
    int64_t* counts = ray_offsets.data_ptr<int64_t>() + 1;  // counts, then inclusive sums in place
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        int64_t count = 0;
        in.for_each_kept(b, occupied, [&](scalar_t, const scalar_t*) { ++count; });
        counts[b] = count;
      }
    });
    for (int64_t b = 1; b < rays; ++b) counts[b] += counts[b - 1];
    const int64_t samples = rays > 0 ? counts[rays - 1] : 0;
    total = at::full({1}, samples, ray_offsets.options());
    const int64_t size = capacity ? *capacity : samples;
    for (int64_t b = 0; b < rays; ++b) counts[b] = std::min(counts[b], size);  // a no-op without a capacity
    std::tie(ray_index, t, points) = march_outputs(size, rays, capacity.has_value(), o.options());
    const int64_t* first = ray_offsets.const_data_ptr<int64_t>();
    int64_t* out_ray = ray_index.data_ptr<int64_t>();
    scalar_t *out_t = t.data_ptr<scalar_t>(), *out_points = points.data_ptr<scalar_t>();
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        int64_t i = first[b];
        const int64_t stop = first[b + 1];  // clamped: an overflowing ray keeps its samples up to the capacity
        in.for_each_kept(b, occupied, [&](scalar_t distance, const scalar_t* unit) {
          if (i >= stop) return;
          out_ray[i] = b;
          out_t[i] = distance;
          for (int a = 0; a < 3; ++a) out_points[3 * i + a] = unit[a];
          ++i;
        });
      }
    });
  });
  return {ray_index, t, points, ray_offsets, total};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_cpu(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab) {
  auto [ray, t, points, ray_offsets, total] = march_packed_cpu(origins, directions, t_start, t_end, offset, occupancy,
                                                               box, step, max_samples, t_split, std::nullopt, slab);
  return {ray, t, points, ray_offsets};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_capped_cpu(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    int64_t capacity, const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab) {
  return march_packed_cpu(origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split,
                          capacity, slab);
}

}  // namespace cuda_ext
