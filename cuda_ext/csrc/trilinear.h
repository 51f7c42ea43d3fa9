// Shared by cpu/trilinear.cpp and cuda/trilinear.cu: input validation (host only) and the
// trilinear weight math (host and device), so both halves compute exactly the same formulas.
//
// Corner order of the grid op: k = 4*i0 + 2*i1 + i2, where i_a in {0, 1} picks the low or high
// voxel along grid axis a. The pairwise op orders its corners k = 4*iu + 2*iw + iv, with
// (u, v, w) = (points + 1) / 2: corner 1 has weight (1-u) v (1-w), corner 2 (1-u)(1-v) w
// (pair_corner_weights / pair_fraction_grads below).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernel_common.h"  // check_device_type

#if defined(__CUDACC__)
#define CUDA_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CUDA_EXT_HOST_DEVICE inline
#endif

namespace cuda_ext {
namespace trilinear {

// ------------------------------------------------------------------------------ validation

// The CPU kernels are instantiated for float32/float64; CUDA adds float16/bfloat16.
inline void check_floating(const at::Tensor& t, const char* op, const char* name, bool allow_half) {
  const auto dtype = t.scalar_type();
  const bool full = dtype == at::kFloat || dtype == at::kDouble;
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  TORCH_CHECK(full || (half && allow_half), op, ": ", name, " must be float32 or float64",
              allow_half ? " (or float16/bfloat16)" : " on the CPU (float16/bfloat16 are CUDA only)",
              ", got ", dtype);
}

inline void check_points(const at::Tensor& points, const char* op) {
  TORCH_CHECK(points.dim() == 2 && points.size(1) == 3, op, ": points must have shape (N, 3), got ",
              points.sizes());
}

// t (named name) must have the dtype and device of ref (named ref_name).
inline void check_same_kind(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name,
                            const char* op) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " and ", ref_name,
              " must be on the same device, got ", t.device(), " and ", ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " and ", ref_name,
              " must have the same dtype, got ", t.scalar_type(), " and ", ref.scalar_type());
}

// feats (N, 8, F), points (N, 3), same dtype and device.
inline void check_pair_inputs(const at::Tensor& feats, const at::Tensor& points, at::DeviceType device,
                              const char* op) {
  TORCH_CHECK(feats.dim() == 3, op, ": feats must have shape (N, 8, F), got ", feats.sizes());
  TORCH_CHECK(feats.size(1) == 8, op, ": feats must hold 8 corners in dim 1 (shape (N, 8, F)), got ",
              feats.sizes());
  check_points(points, op);
  TORCH_CHECK(points.size(0) == feats.size(0), op, ": points has N=", points.size(0),
              " rows but feats has N=", feats.size(0));
  check_device_type(feats, "feats", device, op);
  check_same_kind(points, "points", feats, "feats", op);
  check_floating(feats, op, "feats", device == at::kCUDA);
}

// grid (R0, R1, R2, C) with every R > 0 (C may be 0), points (N, 3), same dtype and device.
inline void check_grid_inputs(const at::Tensor& grid, const at::Tensor& points, at::DeviceType device,
                              const char* op) {
  TORCH_CHECK(grid.dim() == 4, op, ": grid must have shape (R0, R1, R2, C), got ", grid.sizes());
  for (int64_t axis = 0; axis < 3; ++axis) {
    TORCH_CHECK(grid.size(axis) > 0, op, ": grid has an empty axis ", axis, " (shape ", grid.sizes(),
                "); every grid axis needs at least one voxel");
  }
  check_points(points, op);
  check_device_type(grid, "grid", device, op);
  check_same_kind(points, "points", grid, "grid", op);
  check_floating(grid, op, "grid", device == at::kCUDA);
}

// CUDA_EXT_GRID_REORDER: in which order the CUDA grid forward visits its points (cuda/point_buckets.cuh):
// "auto" (the default: in axis-0 bucket order where that can pay), "off" (as given), "always" (in bucket
// order whenever the dtype allows, even for small inputs: for tests). Read at every lookup; a bad value is
// an error on both backends, so a typo never passes silently on one. The CPU kernel ignores the mode.
enum class ReorderMode { kAuto, kOff, kAlways };

inline ReorderMode reorder_mode(const char* op) {
  const char* value = std::getenv("CUDA_EXT_GRID_REORDER");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return ReorderMode::kAuto;
  if (std::strcmp(value, "off") == 0) return ReorderMode::kOff;
  if (std::strcmp(value, "always") == 0) return ReorderMode::kAlways;
  TORCH_CHECK(false, op, ": the environment variable CUDA_EXT_GRID_REORDER must be auto, off or always, got '",
              value, "'");
}

// grad_out must be (N, F) like the forward's output, with the inputs' dtype and device.
inline void check_grad_out(const at::Tensor& grad_out, int64_t n, int64_t f, const at::Tensor& ref,
                           const char* ref_name, const char* op) {
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == n && grad_out.size(1) == f, op,
              ": grad_out must have shape (", n, ", ", f, ") like the forward output, got ", grad_out.sizes());
  check_same_kind(grad_out, "grad_out", ref, ref_name, op);
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

// Pairwise op: weights of the 8 corners in its order k = 4*iu + 2*iw + iv, i.e. corner_weights with
// w as the middle axis and v as the last:
//   w[1] = (1-u) v (1-w), w[2] = (1-u)(1-v) w, w[5] = u v (1-w), w[6] = u (1-v) w.
template <typename T>
CUDA_EXT_HOST_DEVICE void pair_corner_weights(T u, T v, T w, T weights[8]) {
  corner_weights(u, w, v, weights);
}

// Pairwise op: d(sum_k weight_k * d_k)/d(u, v, w) in that order, for pair_corner_weights' order.
template <typename T>
CUDA_EXT_HOST_DEVICE void pair_fraction_grads(T u, T v, T w, const T d[8], T grad[3]) {
  T g[3];  // gradient with respect to (u, w, v)
  fraction_grads(u, w, v, d, g);
  grad[0] = g[0];
  grad[1] = g[2];
  grad[2] = g[1];
}

// Pairwise op: fraction along an axis from a local coordinate in [-1, 1]; d(fraction)/dx = 1/2.
template <typename T>
CUDA_EXT_HOST_DEVICE T local_fraction(T x) {
  return (x + T(1)) / T(2);
}

// Where a point falls along one grid axis of `size` voxels (align_corners=True, border clamp).
template <typename T>
struct AxisSample {
  int64_t lo;  // low voxel index
  int64_t hi;  // high voxel index (== lo only when size == 1)
  T t;         // fraction towards hi, in [0, 1]
  T dt_dx;     // d t / d point coordinate: (size-1)/2 inside the grid, 0 where the clamp holds
};

template <typename T>
CUDA_EXT_HOST_DEVICE AxisSample<T> sample_axis(T x, int64_t size) {
  const T last = T(size - 1);
  const T p = (x + T(1)) / T(2) * last;  // same operation order as the reference
  // Written so that NaN lands on 0 and any index stays inside the grid; the NaN is put back
  // into t below so it shows in the output instead of a silent voxel-0 value.
  T clamped = p > T(0) ? p : T(0);
  clamped = clamped < last ? clamped : last;
  int64_t lo = static_cast<int64_t>(clamped);  // clamped >= 0, so truncation is floor
  const int64_t lo_max = size >= 2 ? size - 2 : 0;  // keep lo+1 inside; t then reaches 1 at the end
  lo = lo < lo_max ? lo : lo_max;
  AxisSample<T> s;
  s.lo = lo;
  s.hi = lo + 1 < size ? lo + 1 : size - 1;
  s.t = p != p ? p : clamped - T(lo);
  // One-sided (inside) derivative at the clamp edges p == 0 and p == R-1.
  s.dt_dx = (p >= T(0) && p <= last) ? last / T(2) : T(0);
  return s;
}

// The 8 voxels around a point of a channels-last (R0, R1, R2, C) grid, with weights.
template <typename T>
struct GridCorners {
  int64_t offset[8];  // element offset of corner k's channel 0
  T weight[8];
  T t[3];
  T dt_dx[3];
};

template <typename T>
CUDA_EXT_HOST_DEVICE void locate_in_grid(T x0, T x1, T x2, int64_t r0, int64_t r1, int64_t r2, int64_t channels,
                                         GridCorners<T>& c) {
  const AxisSample<T> a0 = sample_axis(x0, r0), a1 = sample_axis(x1, r1), a2 = sample_axis(x2, r2);
  c.t[0] = a0.t;
  c.t[1] = a1.t;
  c.t[2] = a2.t;
  c.dt_dx[0] = a0.dt_dx;
  c.dt_dx[1] = a1.dt_dx;
  c.dt_dx[2] = a2.dt_dx;
  corner_weights(a0.t, a1.t, a2.t, c.weight);
  const int64_t row_lo_lo = (a0.lo * r1 + a1.lo) * r2, row_lo_hi = (a0.lo * r1 + a1.hi) * r2;
  const int64_t row_hi_lo = (a0.hi * r1 + a1.lo) * r2, row_hi_hi = (a0.hi * r1 + a1.hi) * r2;
  c.offset[0] = (row_lo_lo + a2.lo) * channels;
  c.offset[1] = (row_lo_lo + a2.hi) * channels;
  c.offset[2] = (row_lo_hi + a2.lo) * channels;
  c.offset[3] = (row_lo_hi + a2.hi) * channels;
  c.offset[4] = (row_hi_lo + a2.lo) * channels;
  c.offset[5] = (row_hi_lo + a2.hi) * channels;
  c.offset[6] = (row_hi_hi + a2.lo) * channels;
  c.offset[7] = (row_hi_hi + a2.hi) * channels;
}

// Gradient with respect to the point from the per-corner dot products d_k = <grad_out, voxel k>.
template <typename T>
CUDA_EXT_HOST_DEVICE void grid_point_grads(const GridCorners<T>& c, const T d[8], T grad[3]) {
  fraction_grads(c.t[0], c.t[1], c.t[2], d, grad);
  grad[0] *= c.dt_dx[0];
  grad[1] *= c.dt_dx[1];
  grad[2] *= c.dt_dx[2];
}

}  // namespace trilinear
}  // namespace cuda_ext
