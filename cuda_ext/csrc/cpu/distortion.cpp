// distortion_loss on the CPU: one task per range of rays (at::parallel_for); a ray is one pass in the forward and
// two in the backward (distortion.h has the formulas).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "distortion.h"
#include "ops.h"
#include "render.h"

namespace cuda_ext {
namespace {

constexpr int64_t kRayGrain = 256;  // rays per task

template <typename scalar_t>
struct RaySums {
  scalar_t weight = 0, moment = 0, loss = 0;  // W, M (sums of w and w m) and L_b
};

// One ray's pass over samples [first, last): its totals; with g_sd, also each sample's gradient (scaled by g),
// given the totals of a first pass.
template <typename scalar_t>
RaySums<scalar_t> distortion_ray(const scalar_t* sd, const scalar_t* t0, const scalar_t* t1, int64_t first,
                                 int64_t last, const RaySums<scalar_t>* totals, scalar_t g, scalar_t* g_sd) {
  RaySums<scalar_t> before;          // W_i, M_i, and the loss so far
  scalar_t optical = 0, prefix = 0;  // sum of s before i; sum of w G up to i (backward)
  const scalar_t a0 = first < last ? t0[first] : 0, z0 = first < last ? t1[first] : 0;  // see distortion.h
  for (int64_t i = first; i < last; ++i) {
    const scalar_t transmittance = std::exp(-optical);
    const scalar_t w = transmittance * -std::expm1(-sd[i]);
    const scalar_t m = ((t0[i] - a0) + (t1[i] - z0)) / 2, d = t1[i] - t0[i];
    if (g_sd != nullptr) {
      const scalar_t after_w = totals->weight - before.weight - w, after_m = totals->moment - before.moment - w * m;
      const scalar_t grad_w = 2 * (m * before.weight - before.moment) + 2 * (after_m - m * after_w) + 2 * w * d / 3;
      prefix += w * grad_w;
      g_sd[i] = g * ((transmittance - w) * grad_w - (2 * totals->loss - prefix));
    }
    before.loss += 2 * w * (m * before.weight - before.moment) + w * w * d / 3;
    before.weight += w;
    before.moment += w * m;
    optical += sd[i];
  }
  return before;
}

}  // namespace

at::Tensor distortion_loss_cpu(const at::Tensor& optical_depth_in, const at::Tensor& t_start_in,
                               const at::Tensor& t_end_in, const at::Tensor& ray_offsets_in) {
  const char* op = "distortion_loss";
  check_distortion_inputs(optical_depth_in, t_start_in, t_end_in, ray_offsets_in, at::kCPU, op);
  const at::Tensor sd = optical_depth_in.contiguous(), t0 = t_start_in.contiguous(), t1 = t_end_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous();
  check_render_offsets(offsets, sd.size(0), op);
  const int64_t rays = offsets.size(0) - 1;
  at::Tensor loss = at::empty({rays}, sd.options());
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "distortion_loss_cpu", [&] {
    const int64_t* o = offsets.const_data_ptr<int64_t>();
    scalar_t* out = loss.data_ptr<scalar_t>();
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        out[b] = distortion_ray<scalar_t>(sd.const_data_ptr<scalar_t>(), t0.const_data_ptr<scalar_t>(),
                                          t1.const_data_ptr<scalar_t>(), o[b], o[b + 1], nullptr, 0, nullptr)
                     .loss;
      }
    });
  });
  return loss;
}

at::Tensor distortion_loss_backward_cpu(const at::Tensor& grad_in, const at::Tensor& optical_depth_in,
                                        const at::Tensor& t_start_in, const at::Tensor& t_end_in,
                                        const at::Tensor& ray_offsets_in) {
  const char* op = "distortion_loss_backward";
  check_distortion_inputs(optical_depth_in, t_start_in, t_end_in, ray_offsets_in, at::kCPU, op);
  const int64_t rays = ray_offsets_in.size(0) - 1;
  check_distortion_grad(grad_in, optical_depth_in, rays, op);
  const at::Tensor sd = optical_depth_in.contiguous(), t0 = t_start_in.contiguous(), t1 = t_end_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous(), grad = grad_in.contiguous();
  check_render_offsets(offsets, sd.size(0), op);
  at::Tensor g_sd = at::zeros_like(sd);  // the rows past the last offset (padding) get zero
  AT_DISPATCH_FLOATING_TYPES(sd.scalar_type(), "distortion_loss_backward_cpu", [&] {
    const int64_t* o = offsets.const_data_ptr<int64_t>();
    const scalar_t *s = sd.const_data_ptr<scalar_t>(), *a = t0.const_data_ptr<scalar_t>();
    const scalar_t *z = t1.const_data_ptr<scalar_t>(), *g = grad.const_data_ptr<scalar_t>();
    scalar_t* out = g_sd.data_ptr<scalar_t>();
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const RaySums<scalar_t> totals = distortion_ray<scalar_t>(s, a, z, o[b], o[b + 1], nullptr, 0, nullptr);
        distortion_ray<scalar_t>(s, a, z, o[b], o[b + 1], &totals, g[b], out);
      }
    });
  });
  return g_sd;
}

}  // namespace cuda_ext
