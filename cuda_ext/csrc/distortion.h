// distortion_loss: mip-NeRF 360's distortion loss of packed samples (ray b owns [ray_offsets[b],
// ray_offsets[b+1]), in order along it), from their optical depths, with the weights volume_render composites.
// Argument checks shared by the CPU kernel (cpu/distortion.cpp) and the CUDA kernel (cuda/distortion.cu).
//
//   w_i = T_i (1 - exp(-s_i)),  m_i = (t0_i + t1_i) / 2,  d_i = t1_i - t0_i,
//   L_b = sum_ij w_i w_j |m_i - m_j| + 1/3 sum_i w_i^2 d_i = sum_i [2 w_i (m_i W_i - M_i) + w_i^2 d_i / 3],
//
// with W_i = sum_{j<i} w_j and M_i = sum_{j<i} w_j m_j (the midpoints increase along a ray): one pass. Backward,
// with W, M the ray's totals and g = dloss/dL_b:
//
//   G_i = dL_b/dw_i = 2 (m_i W_i - M_i) + 2 ((M - M_i - w_i m_i) - m_i (W - W_i - w_i)) + 2/3 w_i d_i,
//   dL_b/ds_k = T_{k+1} G_k - sum_{i>k} w_i G_i,   sum_i w_i G_i = 2 L_b
//
// (L_b is homogeneous of degree 2 in w), so the suffix is 2 L_b minus a running sum: a first pass for W, M and
// L_b, a second for the gradients. t0, t1 are data (not differentiated). The kernels measure the midpoints from
// the ray's first one, m_i - m_0 = ((t0_i - t0_0) + (t1_i - t1_0)) / 2 (L_b and G_i depend only on differences of
// midpoints; those of nearby floats are exact): far along a ray, (t0 + t1) / 2 and m_i W_i - M_i would round
// away the intervals in float32.
#pragma once

#include "kernel_common.h"

namespace cuda_ext {

inline void check_distortion_inputs(const at::Tensor& optical_depth, const at::Tensor& t_start, const at::Tensor& t_end,
                                    const at::Tensor& ray_offsets, at::DeviceType device, const char* op) {
  TORCH_CHECK(optical_depth.dim() == 1, op, ": optical_depth must have shape (N,), got ", optical_depth.sizes());
  const int64_t n = optical_depth.size(0);
  TORCH_CHECK(t_start.dim() == 1 && t_start.size(0) == n, op, ": t_start must have shape (N,) with N = ", n, ", got ",
              t_start.sizes());
  TORCH_CHECK(t_end.dim() == 1 && t_end.size(0) == n, op, ": t_end must have shape (N,) with N = ", n, ", got ",
              t_end.sizes());
  TORCH_CHECK(ray_offsets.dim() == 1 && ray_offsets.size(0) >= 1, op, ": ray_offsets must have shape (B + 1,), got ",
              ray_offsets.sizes());
  TORCH_CHECK(ray_offsets.scalar_type() == at::kLong, op, ": ray_offsets must be int64, got ",
              ray_offsets.scalar_type());
  check_device_type(optical_depth, "optical_depth", device, op);
  TORCH_CHECK(optical_depth.scalar_type() == at::kFloat || optical_depth.scalar_type() == at::kDouble, op,
              ": optical_depth must be float32 or float64, got ", optical_depth.scalar_type());
  check_same_device_and_dtype(t_start, optical_depth, op, "t_start", "optical_depth");
  check_same_device_and_dtype(t_end, optical_depth, op, "t_end", "optical_depth");
  TORCH_CHECK(ray_offsets.device() == optical_depth.device(), op,
              ": ray_offsets must be on the same device as optical_depth (", optical_depth.device(), "), got ",
              ray_offsets.device());
}

inline void check_distortion_grad(const at::Tensor& grad, const at::Tensor& optical_depth, int64_t rays,
                                  const char* op) {
  TORCH_CHECK(grad.dim() == 1 && grad.size(0) == rays, op, ": grad must have shape (", rays, ",), got ", grad.sizes());
  check_same_device_and_dtype(grad, optical_depth, op, "grad", "optical_depth");
}

}  // namespace cuda_ext
