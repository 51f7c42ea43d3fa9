// volume_render: alpha compositing of packed samples (the samples of ray b at [ray_offsets[b],
// ray_offsets[b+1]), in order along the ray). Argument checks shared by the CPU kernel (cpu/render.cpp)
// and the CUDA kernel (cuda/render.cu).
//
//   T_i = exp(-sum_{j<i} s_j),  w_i = T_i (1 - exp(-s_i)),
//   values_b = sum_i w_i v_i,  opacity_b = sum_i w_i,  depth_b = sum_i w_i t_i,
//
// with samples whose T_i < early_stop (when early_stop > 0) left out: transmittance only falls along a ray,
// so they are its tail and the loop stops there. The backward needs no per-sample intermediates: with
// g_i = <grad_values_b, v_i> + grad_opacity_b + grad_depth_b t_i and G_b = sum_i w_i g_i (= the same
// product with the forward's outputs),
//   d/ds_k = T_{k+1} g_k - (G_b - sum_{i<=k} w_i g_i),   d/dv_k = w_k grad_values_b.
#pragma once

#include "kernel_common.h"

namespace cuda_ext {

inline void check_render_inputs(const at::Tensor& optical_depth, const at::Tensor& values, const at::Tensor& t,
                                const at::Tensor& ray_offsets, double early_stop, at::DeviceType device,
                                const char* op) {
  TORCH_CHECK(optical_depth.dim() == 1, op, ": optical_depth must have shape (N,), got ", optical_depth.sizes());
  const int64_t n = optical_depth.size(0);
  TORCH_CHECK(values.dim() == 2 && values.size(0) == n, op, ": values must have shape (N, C) with N = ", n, ", got ",
              values.sizes());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": t must have shape (N,) with N = ", n, ", got ", t.sizes());
  TORCH_CHECK(ray_offsets.dim() == 1 && ray_offsets.size(0) >= 1, op, ": ray_offsets must have shape (B + 1,), got ",
              ray_offsets.sizes());
  TORCH_CHECK(ray_offsets.scalar_type() == at::kLong, op, ": ray_offsets must be int64, got ",
              ray_offsets.scalar_type());
  TORCH_CHECK(early_stop >= 0.0 && early_stop < 1.0, op, ": early_stop must be in [0, 1), got ", early_stop);
  check_device_type(optical_depth, "optical_depth", device, op);
  TORCH_CHECK(optical_depth.scalar_type() == at::kFloat || optical_depth.scalar_type() == at::kDouble, op,
              ": optical_depth must be float32 or float64, got ", optical_depth.scalar_type());
  check_same_device_and_dtype(values, optical_depth, op, "values", "optical_depth");
  check_same_device_and_dtype(t, optical_depth, op, "t", "optical_depth");
  TORCH_CHECK(ray_offsets.device() == optical_depth.device(), op,
              ": ray_offsets must be on the same device as optical_depth (", optical_depth.device(), "), got ",
              ray_offsets.device());
}

// The offsets' values (0 first, non-decreasing, N last), read on the host: the CPU kernels only. On CUDA that
// would need a device-to-host copy per call; the CUDA kernels clamp every range to [0, N] instead.
inline void check_render_offsets(const at::Tensor& offsets, int64_t n, const char* op) {
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  const int64_t rays = offsets.size(0) - 1;
  TORCH_CHECK(o[0] == 0, op, ": ray_offsets must start at 0, got ", o[0]);
  TORCH_CHECK(o[rays] <= n, op, ": ray_offsets must end at most at N = ", n,
              " (the number of samples; rows past the end are padding), got ", o[rays]);
  for (int64_t b = 0; b < rays; ++b) {
    TORCH_CHECK(o[b] <= o[b + 1], op, ": ray_offsets must be non-decreasing, got ", o[b], " then ", o[b + 1],
                " at ray ", b);
  }
}

inline void check_render_grads(const at::Tensor& grad_values, const at::Tensor& grad_opacity,
                               const at::Tensor& grad_depth, const at::Tensor& values, int64_t rays, const char* op) {
  TORCH_CHECK(grad_values.dim() == 2 && grad_values.size(0) == rays && grad_values.size(1) == values.size(1), op,
              ": grad_values must have shape (B, C) = (", rays, ", ", values.size(1), "), got ", grad_values.sizes());
  TORCH_CHECK(grad_opacity.dim() == 1 && grad_opacity.size(0) == rays, op, ": grad_opacity must have shape (", rays,
              ",), got ", grad_opacity.sizes());
  TORCH_CHECK(grad_depth.dim() == 1 && grad_depth.size(0) == rays, op, ": grad_depth must have shape (", rays,
              ",), got ", grad_depth.sizes());
  check_same_device_and_dtype(grad_values, values, op, "grad_values", "values");
  check_same_device_and_dtype(grad_opacity, values, op, "grad_opacity", "values");
  check_same_device_and_dtype(grad_depth, values, op, "grad_depth", "values");
}

}  // namespace cuda_ext
