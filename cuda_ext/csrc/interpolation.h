// What the two trilinear ops share, the pairwise trilinear_interpolate (trilinear.h) and the grid lookup
// grid_interpolate (grid_interpolate.h): the checks of their common arguments (host), the corner-weight
// math (host and device), and how their CPU kernels split points over threads.
//
// Corner order: k = 4*i0 + 2*i1 + i2, where i_a in {0, 1} picks the low or high end along axis a.
#pragma once

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <cstdint>

#include "kernel_common.h"

namespace cuda_ext {

// ------------------------------------------------------------------------------ validation

inline void check_points(const at::Tensor& points, const char* op) {
  TORCH_CHECK(points.dim() == 2 && points.size(1) == 3, op, ": points must have shape (N, 3), got ", points.sizes());
}

// grad_out must be (N, F) like the forward's output, with the inputs' dtype and device.
inline void check_grad_out(const at::Tensor& grad_out, int64_t n, int64_t f, const at::Tensor& ref,
                           const char* ref_name, const char* op) {
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == n && grad_out.size(1) == f, op, ": grad_out must have shape (",
              n, ", ", f, ") like the forward output, got ", grad_out.sizes());
  check_same_device_and_dtype(grad_out, ref, op, "grad_out", ref_name);
}

// A gradient that was not requested comes back as an empty tensor (shape (0,)), as the schemas say.
inline at::Tensor no_grad_placeholder(const at::Tensor& like) { return at::empty({0}, like.options()); }

// CPU kernels: points per at::parallel_for task, so that a task touches roughly GRAIN_SIZE elements.
inline int64_t grain_for(int64_t elements_per_point) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, elements_per_point));
}

// ------------------------------------------------------------------------------ weight math

// Weights of the 8 corners at fractions (t0, t1, t2) along the three axes.
template <typename T>
CUDA_EXT_HOST_DEVICE void corner_weights(T t0, T t1, T t2, T w[8]) {
  const T s0 = T(1) - t0, s1 = T(1) - t1, s2 = T(1) - t2;
  const T ll = s1 * s2, lh = s1 * t2, hl = t1 * s2, hh = t1 * t2;
  w[0] = s0 * ll;
  w[1] = s0 * lh;
  w[2] = s0 * hl;
  w[3] = s0 * hh;
  w[4] = t0 * ll;
  w[5] = t0 * lh;
  w[6] = t0 * hl;
  w[7] = t0 * hh;
}

// d(sum_k w_k * d_k)/dt_a for a = 0, 1, 2, where d_k = <grad_out, corner k's values>.
// The blend is linear in the corner values, so this turns per-corner dot products into the
// gradient with respect to the fractions.
template <typename T>
CUDA_EXT_HOST_DEVICE void fraction_grads(T t0, T t1, T t2, const T d[8], T grad[3]) {
  const T s0 = T(1) - t0, s1 = T(1) - t1, s2 = T(1) - t2;
  grad[0] = s1 * (s2 * (d[4] - d[0]) + t2 * (d[5] - d[1])) + t1 * (s2 * (d[6] - d[2]) + t2 * (d[7] - d[3]));
  grad[1] = s0 * (s2 * (d[2] - d[0]) + t2 * (d[3] - d[1])) + t0 * (s2 * (d[6] - d[4]) + t2 * (d[7] - d[5]));
  grad[2] = s0 * (s1 * (d[1] - d[0]) + t1 * (d[3] - d[2])) + t0 * (s1 * (d[5] - d[4]) + t1 * (d[7] - d[6]));
}

}  // namespace cuda_ext
