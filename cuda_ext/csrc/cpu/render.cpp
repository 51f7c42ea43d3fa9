// volume_render on the CPU: one task per range of rays (at::parallel_for), each ray one pass over its
// samples in the forward and one in the backward (render.h has the formulas).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "render.h"

namespace cuda_ext {
namespace {

constexpr int64_t kRayGrain = 256;  // rays per task

template <typename scalar_t>
void render_forward_rays(const scalar_t* sd, const scalar_t* v, const scalar_t* t, const int64_t* offsets, int64_t n,
                         int64_t channels, scalar_t early_stop, scalar_t* out, scalar_t* opacity, scalar_t* depth,
                         int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const int64_t first = std::max<int64_t>(offsets[b], 0), last = std::min<int64_t>(offsets[b + 1], n);
    scalar_t* acc = out + b * channels;
    for (int64_t c = 0; c < channels; ++c) acc[c] = 0;
    scalar_t optical = 0, op = 0, dp = 0;  // optical: sum of s before sample i
    for (int64_t i = first; i < last; ++i) {
      const scalar_t transmittance = std::exp(-optical);
      if (transmittance < early_stop) break;
      const scalar_t w = transmittance * -std::expm1(-sd[i]);
      for (int64_t c = 0; c < channels; ++c) acc[c] += w * v[i * channels + c];
      op += w;
      dp += w * t[i];
      optical += sd[i];
    }
    opacity[b] = op;
    depth[b] = dp;
  }
}

template <typename scalar_t>
void render_backward_rays(const scalar_t* sd, const scalar_t* v, const scalar_t* t, const int64_t* offsets, int64_t n,
                          int64_t channels, scalar_t early_stop, const scalar_t* out, const scalar_t* opacity,
                          const scalar_t* depth, const scalar_t* g_out, const scalar_t* g_op, const scalar_t* g_dp,
                          scalar_t* g_sd, scalar_t* g_v, int64_t begin, int64_t end) {
  for (int64_t b = begin; b < end; ++b) {
    const scalar_t* go = g_out + b * channels;
    scalar_t total = g_op[b] * opacity[b] + g_dp[b] * depth[b];  // G_b = sum_i w_i g_i
    for (int64_t c = 0; c < channels; ++c) total += go[c] * out[b * channels + c];
    scalar_t optical = 0, prefix = 0;
    const int64_t first = std::max<int64_t>(offsets[b], 0), last = std::min<int64_t>(offsets[b + 1], n);
    for (int64_t i = first; i < last; ++i) {
      const scalar_t transmittance = std::exp(-optical);
      if (transmittance < early_stop) break;
      // w as the forward computes it (expm1: no cancellation for small s), T_{i+1} = T_i - w_i
      const scalar_t w = transmittance * -std::expm1(-sd[i]);
      const scalar_t after = transmittance - w;
      scalar_t g = g_op[b] + g_dp[b] * t[i];
      for (int64_t c = 0; c < channels; ++c) {
        g += go[c] * v[i * channels + c];
        g_v[i * channels + c] = w * go[c];
      }
      prefix += w * g;
      g_sd[i] = after * g - (total - prefix);
      optical += sd[i];
    }  // the terminated tail keeps the zeros it was allocated with: no contribution, no gradient
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> volume_render_cpu(const at::Tensor& optical_depth_in,
                                                                 const at::Tensor& values_in, const at::Tensor& t_in,
                                                                 const at::Tensor& ray_offsets_in, double early_stop) {
  check_render_inputs(optical_depth_in, values_in, t_in, ray_offsets_in, early_stop, at::kCPU, "volume_render");
  const at::Tensor sd = optical_depth_in.contiguous(), v = values_in.contiguous(), t = t_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous();
  check_render_offsets(offsets, sd.size(0), "volume_render");
  const int64_t rays = offsets.size(0) - 1, channels = v.size(1);
  at::Tensor out = at::empty({rays, channels}, v.options());
  at::Tensor opacity = at::empty({rays}, v.options()), depth = at::empty({rays}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "volume_render_cpu", [&] {
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      render_forward_rays<scalar_t>(sd.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
                                    t.const_data_ptr<scalar_t>(), offsets.const_data_ptr<int64_t>(), sd.size(0),
                                    channels, static_cast<scalar_t>(early_stop), out.data_ptr<scalar_t>(),
                                    opacity.data_ptr<scalar_t>(), depth.data_ptr<scalar_t>(), begin, end);
    });
  });
  return {out, opacity, depth};
}

std::tuple<at::Tensor, at::Tensor> volume_render_backward_cpu(
    const at::Tensor& grad_values_in, const at::Tensor& grad_opacity_in, const at::Tensor& grad_depth_in,
    const at::Tensor& optical_depth_in, const at::Tensor& values_in, const at::Tensor& t_in,
    const at::Tensor& ray_offsets_in, const at::Tensor& out_in, const at::Tensor& opacity_in,
    const at::Tensor& depth_in, double early_stop) {
  const char* op = "volume_render_backward";
  check_render_inputs(optical_depth_in, values_in, t_in, ray_offsets_in, early_stop, at::kCPU, op);
  const int64_t rays = ray_offsets_in.size(0) - 1;
  check_render_grads(grad_values_in, grad_opacity_in, grad_depth_in, values_in, rays, op);
  check_render_grads(out_in, opacity_in, depth_in, values_in, rays, op);
  const at::Tensor sd = optical_depth_in.contiguous(), v = values_in.contiguous(), t = t_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous(), out = out_in.contiguous();
  check_render_offsets(offsets, sd.size(0), op);
  const at::Tensor opacity = opacity_in.contiguous(), depth = depth_in.contiguous();
  const at::Tensor g_out = grad_values_in.contiguous(), g_op = grad_opacity_in.contiguous();
  const at::Tensor g_dp = grad_depth_in.contiguous();
  at::Tensor g_sd = at::zeros_like(sd), g_v = at::zeros_like(v);  // samples a ray never reaches get zero
  const int64_t channels = v.size(1);
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "volume_render_backward_cpu", [&] {
    at::parallel_for(0, rays, kRayGrain, [&](int64_t begin, int64_t end) {
      render_backward_rays<scalar_t>(
          sd.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), t.const_data_ptr<scalar_t>(),
          offsets.const_data_ptr<int64_t>(), sd.size(0), channels, static_cast<scalar_t>(early_stop),
          out.const_data_ptr<scalar_t>(), opacity.const_data_ptr<scalar_t>(), depth.const_data_ptr<scalar_t>(),
          g_out.const_data_ptr<scalar_t>(), g_op.const_data_ptr<scalar_t>(), g_dp.const_data_ptr<scalar_t>(),
          g_sd.data_ptr<scalar_t>(), g_v.data_ptr<scalar_t>(), begin, end);
    });
  });
  return {g_sd, g_v};
}

}  // namespace cuda_ext
