// The fused grid lookup grid_interpolate: a dense channels-last grid (R0, R1, R2, C) read at points (N, 3)
// in [-1, 1]^3 (align_corners=True, border clamp), the 8 voxels around each point blended in the corner
// order of interpolation.h. Input validation (host), the grid's shape, and where a point's voxels lie with
// their weights (host and device), shared by cpu/grid_interpolate.cpp and cuda/grid_interpolate*.cu; the
// sparse lookup (brick_grid.h) locates points with the same sample_axis and CornerFractions.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "interpolation.h"
#include "kernel_common.h"

namespace cuda_ext {

// ------------------------------------------------------------------------------ validation

// grid (R0, R1, R2, C) with every R > 0 (C may be 0), points (N, 3), same dtype and device.
inline void check_grid_inputs(const at::Tensor& grid, const at::Tensor& points, at::DeviceType device, const char* op) {
  TORCH_CHECK(grid.dim() == 4, op, ": grid must have shape (R0, R1, R2, C), got ", grid.sizes());
  for (int64_t axis = 0; axis < 3; ++axis) {
    TORCH_CHECK(grid.size(axis) > 0, op, ": grid has an empty axis ", axis, " (shape ", grid.sizes(),
                "); every grid axis needs at least one voxel");
  }
  check_points(points, op);
  check_device_type(grid, "grid", device, op);
  check_same_device_and_dtype(points, grid, op, "points", "grid");
  check_floating_dtype(grid, op, "grid");
}

// ------------------------------------------------------------------------------ grid geometry

// A grid's shape: r0 x r1 x r2 voxels of `channels` contiguous values each (channels-last).
struct GridShape {
  int64_t r0, r1, r2, channels;
};

inline GridShape grid_shape(const at::Tensor& grid) { return {grid.size(0), grid.size(1), grid.size(2), grid.size(3)}; }

// The CUDA kernels move 4 channels at a time when C % 4 == 0 (16 bytes of float32, one float4 atomic).
constexpr int kGridVec = 4;

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
  int64_t lo = static_cast<int64_t>(clamped);       // clamped >= 0, so truncation is floor
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

// A point's fractions along the 3 axes and their derivatives: what the corner weights and the point
// gradient need, whichever way the 8 corners are stored (GridCorners here, BrickCorners in brick_grid.h).
template <typename T>
struct CornerFractions {
  T t[3];
  T dt_dx[3];

  CUDA_EXT_HOST_DEVICE void set_axes(const AxisSample<T>& a0, const AxisSample<T>& a1, const AxisSample<T>& a2) {
    t[0] = a0.t;
    t[1] = a1.t;
    t[2] = a2.t;
    dt_dx[0] = a0.dt_dx;
    dt_dx[1] = a1.dt_dx;
    dt_dx[2] = a2.dt_dx;
  }
  // Corner k's weight, recomputed (the CUDA forward: cheaper than 8 registers). The CPU kernels take all
  // 8 from corner_weights(t), whose products are grouped differently (equal up to the last bit).
  CUDA_EXT_HOST_DEVICE T weight(int k) const {
    return ((k & 4) ? t[0] : T(1) - t[0]) * ((k & 2) ? t[1] : T(1) - t[1]) * ((k & 1) ? t[2] : T(1) - t[2]);
  }
};

// The 8 voxels around a point in a dense grid: corner 0's element offset, one step per axis to the high
// voxel, and the fractions (with their derivatives). Few registers: offsets and weights are derived per corner.
template <typename T>
struct GridCorners : CornerFractions<T> {
  int64_t base;  // element offset of corner 0's channel 0
  int64_t step[3];

  CUDA_EXT_HOST_DEVICE int64_t step_to(int k) const {  // corner k's offset - corner 0's
    return ((k & 4) ? step[0] : 0) + ((k & 2) ? step[1] : 0) + ((k & 1) ? step[2] : 0);
  }
  CUDA_EXT_HOST_DEVICE int64_t offset(int k) const { return base + step_to(k); }
};

template <typename T>
CUDA_EXT_HOST_DEVICE GridCorners<T> locate_corners(T x0, T x1, T x2, const GridShape& s) {
  const AxisSample<T> a0 = sample_axis(x0, s.r0), a1 = sample_axis(x1, s.r1), a2 = sample_axis(x2, s.r2);
  const int64_t row = s.r2 * s.channels, slice = s.r1 * row;
  GridCorners<T> c;
  c.base = a0.lo * slice + a1.lo * row + a2.lo * s.channels;
  c.step[0] = (a0.hi - a0.lo) * slice;
  c.step[1] = (a1.hi - a1.lo) * row;
  c.step[2] = (a2.hi - a2.lo) * s.channels;
  c.set_axes(a0, a1, a2);
  return c;
}

// Gradient with respect to the point from the per-corner dot products d_k = <grad_out, voxel k>
// (d_k = 0 for a corner that reads nothing, such as an empty brick's).
template <typename T>
CUDA_EXT_HOST_DEVICE void grid_point_grads(const CornerFractions<T>& c, const T d[8], T grad[3]) {
  fraction_grads(c.t[0], c.t[1], c.t[2], d, grad);
  grad[0] *= c.dt_dx[0];
  grad[1] *= c.dt_dx[1];
  grad[2] *= c.dt_dx[2];
}

}  // namespace cuda_ext
