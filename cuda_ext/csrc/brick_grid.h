// The sparse grid lookup brick_grid_interpolate: a virtual dense grid of (V0, V1, V2) vertices stored as
// bricks of B^3 vertices. values (M, C) is the brick pool (slot s holds rows [s B^3, (s + 1) B^3), vertex
// (l0, l1, l2) of a brick at row (l0 B + l1) B + l2); table (T0, T1, T2) int32, T_a = ceil(V_a / B), gives
// each brick's slot, and any entry outside [0, M / B^3) marks an empty brick, whose vertices read as zeros.
// Points are located as in grid_interpolate (sample_axis: align_corners=True, border clamp), then each of
// the 8 corners is looked up on its own, so a cell may straddle up to 8 bricks and bricks need no apron.
// Input validation (host) and where a point's corners lie (host and device), shared by cpu/brick_grid.cpp
// and cuda/brick_grid.cu.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "grid_interpolate.h"
#include "interpolation.h"
#include "kernel_common.h"

namespace cuda_ext {

// Limits that keep the index arithmetic exact: B^3 <= 2^30 (a row inside a brick fits int32), and vertex
// indices fit int32, so the device divides them by B in 32 bits.
constexpr int64_t kMaxBrick = 1024;
constexpr int64_t kMaxBrickGridVertices = (int64_t(1) << 31) - 1;

// ------------------------------------------------------------------------------ validation

// values (M, C) floating with M a multiple of brick^3, table (ceil(V0/B), ceil(V1/B), ceil(V2/B)) int32,
// points (N, 3) of values' dtype, shape 3 vertex counts in [1, 2^31 - 1], brick in [1, 1024], one device.
// Same order and wording as cuda_ext/_brick_checks.py.
inline void check_brick_grid_inputs(const at::Tensor& values, const at::Tensor& table, const at::Tensor& points,
                                    at::IntArrayRef shape, int64_t brick, at::DeviceType device, const char* op) {
  TORCH_CHECK(values.dim() == 2, op, ": values must have shape (M, C), got ", values.sizes());
  check_points(points, op);
  TORCH_CHECK(shape.size() == 3, op, ": shape must list 3 vertex counts (V0, V1, V2), got ", shape);
  for (size_t axis = 0; axis < 3; ++axis) {
    TORCH_CHECK(shape[axis] >= 1 && shape[axis] <= kMaxBrickGridVertices, op, ": shape[", axis,
                "] must be a vertex count in [1, ", kMaxBrickGridVertices, "], got shape ", shape);
  }
  TORCH_CHECK(brick >= 1 && brick <= kMaxBrick, op, ": brick must be in [1, ", kMaxBrick, "], got ", brick);
  TORCH_CHECK(table.scalar_type() == at::kInt, op, ": table must be int32, got ", table.scalar_type());
  const int64_t t0 = (shape[0] + brick - 1) / brick, t1 = (shape[1] + brick - 1) / brick,
                t2 = (shape[2] + brick - 1) / brick;
  TORCH_CHECK(table.dim() == 3 && table.size(0) == t0 && table.size(1) == t1 && table.size(2) == t2, op,
              ": table must have shape ceil(shape / brick) = (", t0, ", ", t1, ", ", t2, "), got ", table.sizes());
  const int64_t brick_rows = brick * brick * brick;
  TORCH_CHECK(values.size(0) % brick_rows == 0, op, ": values must hold whole bricks: M = ", values.size(0),
              " is not a multiple of brick^3 = ", brick_rows);
  check_device_type(values, "values", device, op);
  check_same_device_and_dtype(points, values, op, "points", "values");
  TORCH_CHECK(table.device() == values.device(), op, ": table and values must be on the same device, got ",
              table.device(), " and ", values.device());
  check_floating_dtype(values, op, "values");
}

// ------------------------------------------------------------------------------ brick geometry

struct BrickShape {
  int64_t vertices[3];  // V0, V1, V2: the virtual dense grid
  int64_t bricks[3];    // T0, T1, T2: the table
  int64_t slots;        // bricks in the pool, M / B^3
  int64_t channels;     // C
  int32_t brick;        // B
  int32_t brick_rows;   // B^3
};

// For inputs that passed check_brick_grid_inputs.
inline BrickShape brick_shape(const at::Tensor& values, const at::Tensor& table, at::IntArrayRef shape, int64_t brick) {
  BrickShape s;
  for (int axis = 0; axis < 3; ++axis) {
    s.vertices[axis] = shape[axis];
    s.bricks[axis] = table.size(axis);
  }
  s.brick = static_cast<int32_t>(brick);
  s.brick_rows = static_cast<int32_t>(brick * brick * brick);
  s.slots = values.size(0) / s.brick_rows;
  s.channels = values.size(1);
  return s;
}

// A table entry. On the device through the read-only cache: a point reads up to 8 entries of a table that
// is small (a few MB) and read by every point near the same bricks.
CUDA_EXT_HOST_DEVICE int64_t load_table_entry(const int32_t* entry) {
#if defined(__CUDA_ARCH__)
  return __ldg(entry);
#else
  return *entry;
#endif
}

// The 8 corners of a point in a brick grid, as GridCorners stores a dense grid's: corner 0's brick (its
// table index) and its row inside the brick, plus one step per axis to the high corner. A local step is
// negative where the high corner lies in the next brick (local index B - 1 -> 0).
template <typename T>
struct BrickCorners : CornerFractions<T> {
  int64_t table_base;
  int64_t table_step[3];
  int32_t local_base;
  int32_t local_step[3];

  // Corner k's row of values, or -1 when its brick is empty (its table entry is not a slot of the pool).
  CUDA_EXT_HOST_DEVICE int64_t row(int k, const int32_t* table, const BrickShape& s) const {
    const int64_t slot = load_table_entry(table + table_base + ((k & 4) ? table_step[0] : 0) +
                                          ((k & 2) ? table_step[1] : 0) + ((k & 1) ? table_step[2] : 0));
    const int32_t local =
        local_base + ((k & 4) ? local_step[0] : 0) + ((k & 2) ? local_step[1] : 0) + ((k & 1) ? local_step[2] : 0);
    return slot >= 0 && slot < s.slots ? slot * s.brick_rows + local : -1;
  }
};

template <typename T>
CUDA_EXT_HOST_DEVICE BrickCorners<T> locate_brick_corners(T x0, T x1, T x2, const BrickShape& s) {
  const AxisSample<T> a[3] = {sample_axis(x0, s.vertices[0]), sample_axis(x1, s.vertices[1]),
                              sample_axis(x2, s.vertices[2])};
  const int64_t table_stride[3] = {s.bricks[1] * s.bricks[2], s.bricks[2], 1};
  const int32_t local_stride[3] = {s.brick * s.brick, s.brick, 1};
  BrickCorners<T> c;
  c.set_axes(a[0], a[1], a[2]);
  c.table_base = 0;
  c.local_base = 0;
  const uint32_t b = static_cast<uint32_t>(s.brick);
  for (int axis = 0; axis < 3; ++axis) {
    // Vertex indices are < 2^31 (checked): 32-bit divisions, much cheaper than 64-bit ones on the device.
    const uint32_t lo = static_cast<uint32_t>(a[axis].lo), hi = static_cast<uint32_t>(a[axis].hi);
    const uint32_t brick_lo = lo / b, brick_hi = hi / b;
    const int32_t local_lo = static_cast<int32_t>(lo - brick_lo * b),
                  local_hi = static_cast<int32_t>(hi - brick_hi * b);
    c.table_base += int64_t(brick_lo) * table_stride[axis];
    c.table_step[axis] = (int64_t(brick_hi) - int64_t(brick_lo)) * table_stride[axis];
    c.local_base += local_lo * local_stride[axis];
    c.local_step[axis] = (local_hi - local_lo) * local_stride[axis];
  }
  return c;
}

}  // namespace cuda_ext
