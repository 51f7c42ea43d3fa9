// The pairwise op trilinear_interpolate, as in the classic CUDA-extension tutorial
// (kwea123/pytorch-cppcuda-tutorial): every point brings its own 8 corner feature rows, feats (N, 8, F),
// blended at points (N, 3) in [-1, 1]^3. Input validation (host) and the weight math (host and device),
// shared by cpu/trilinear.cpp and cuda/trilinear.cu, so both halves compute exactly the same formulas.
//
// Corner order k = 4*iu + 2*iw + iv, with (u, v, w) = (points + 1) / 2: corner 1 has weight
// (1-u) v (1-w), corner 2 (1-u)(1-v) w. (The tutorial's published code swaps corners 1<->2 and 5<->6.)
#pragma once

#include <ATen/ATen.h>

#include "interpolation.h"
#include "kernel_common.h"

namespace cuda_ext {

// feats (N, 8, F), points (N, 3), same dtype and device.
inline void check_pair_inputs(const at::Tensor& feats, const at::Tensor& points, at::DeviceType device,
                              const char* op) {
  TORCH_CHECK(feats.dim() == 3, op, ": feats must have shape (N, 8, F), got ", feats.sizes());
  TORCH_CHECK(feats.size(1) == 8, op, ": feats must hold 8 corners in dim 1 (shape (N, 8, F)), got ", feats.sizes());
  check_points(points, op);
  TORCH_CHECK(points.size(0) == feats.size(0), op, ": points has N=", points.size(0),
              " rows but feats has N=", feats.size(0));
  check_device_type(feats, "feats", device, op);
  check_same_device_and_dtype(points, feats, op, "points", "feats");
  check_floating_dtype(feats, op, "feats");
}

// Weights of the 8 corners in the pairwise order k = 4*iu + 2*iw + iv, i.e. corner_weights with
// w as the middle axis and v as the last:
//   w[1] = (1-u) v (1-w), w[2] = (1-u)(1-v) w, w[5] = u v (1-w), w[6] = u (1-v) w.
template <typename T>
CUDA_EXT_HOST_DEVICE void pair_corner_weights(T u, T v, T w, T weights[8]) {
  corner_weights(u, w, v, weights);
}

// d(sum_k weight_k * d_k)/d(u, v, w) in that order, for pair_corner_weights' order.
template <typename T>
CUDA_EXT_HOST_DEVICE void pair_fraction_grads(T u, T v, T w, const T d[8], T grad[3]) {
  T g[3];  // gradient with respect to (u, w, v)
  fraction_grads(u, w, v, d, g);
  grad[0] = g[0];
  grad[1] = g[2];
  grad[2] = g[1];
}

// Fraction along an axis from a local coordinate in [-1, 1]; d(fraction)/dx = 1/2.
template <typename T>
CUDA_EXT_HOST_DEVICE T local_fraction(T x) {
  return (x + T(1)) / T(2);
}

}  // namespace cuda_ext
