// What the two trilinear ops share, the pairwise trilinear_interpolate (trilinear.h) and the grid lookup
// grid_interpolate (grid_interpolate.h): the checks of their common arguments (host), the corner-weight
// math (host and device), and how their CPU kernels split points over threads.
//
// Corner order: k = 4*i0 + 2*i1 + i2, where i_a in {0, 1} picks the low or high end along axis a.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE

#include <algorithm>
#include <cstdint>
#include <optional>

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

// Where a lookup's backward adds the gradient of its table `values`: a fresh zero tensor in the accumulation dtype
// (float32 for half/bfloat16), or the caller's `grad_into`, which it adds onto in place (a training step's kept
// gradient: no fill of a 1 GB tensor each step). `grad_into` must be shaped, typed and placed like `values`, be
// contiguous and float32/float64 (the dtype the atomics add in), and comes only with `values_requires_grad`.
inline at::Tensor lookup_grad_target(const at::Tensor& values, const std::optional<at::Tensor>& grad_into,
                                     bool values_requires_grad, const char* values_name, const char* op) {
  if (!grad_into.has_value()) {
    const auto acc_dtype = at::toOpMathType(values.scalar_type());
    return values_requires_grad ? at::zeros(values.sizes(), values.options().dtype(acc_dtype))
                                : no_grad_placeholder(values);
  }
  const at::Tensor& into = *grad_into;
  TORCH_CHECK(values_requires_grad, op, ": grad_into is given, so ", values_name, "_requires_grad must be true");
  TORCH_CHECK(into.sizes() == values.sizes(), op, ": grad_into must have the shape of ", values_name, " ",
              values.sizes(), ", got ", into.sizes());
  check_same_device_and_dtype(into, values, op, "grad_into", values_name);
  TORCH_CHECK(into.scalar_type() == at::kFloat || into.scalar_type() == at::kDouble, op,
              ": grad_into must be float32 or float64 (the atomics' dtype), got ", into.scalar_type());
  TORCH_CHECK(into.is_contiguous(), op, ": grad_into must be contiguous");
  return into;
}

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
