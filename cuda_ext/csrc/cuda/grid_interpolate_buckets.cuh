// Visiting grid_interpolate's points slab by slab, so a lookup over a grid larger than L2 gathers from an
// L2-sized part of it at a time.
//
// Why: random points over a 160^3 x 12 float32 grid (197 MB, four times an H100's L2) miss L2 on most
// gathers, and the forward reads 2.2 GB from DRAM for 0.6 GB of voxels it needs. The same 4M points
// confined to 1/16 of axis 0 take a third of the time (H100: 0.31 against 0.91 ms; bench/README.md).
// So the forward first counts the points per axis-0 bucket of S slices (bucket_count_kernel), writes
// them in bucket order with their original index (bucket_scatter_kernel), and blends them in that
// order: the blocks in flight then cover a slab of S + 1 slices, which stays in L2.
//
// Points that already come in a cache-friendly order (samples sorted along rays, as a NeRF makes them)
// gain nothing and would pay for the reordering, so a one-block probe first looks at a sample of
// consecutive points: if most neighbours share a bucket, the other kernels return at once and the
// lookup visits the points as given. The decision is taken on the device, so nothing synchronises.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "grid_reorder.h"

namespace cuda_ext {

// How the lookup visits its points. sorted == nullptr: in their own order. Otherwise, unless the probe
// set *coherent, slot i holds sorted[i] = (x, y, z, original index as int bits), in bucket order.
struct PointOrder {
  const float4* sorted = nullptr;
  const int* coherent = nullptr;
  __device__ __forceinline__ bool bucketed() const { return sorted != nullptr && !*coherent; }
};

// A PointOrder with the buffers its pointers point into (they must live until the lookup is queued).
struct BucketedPoints {
  at::Tensor sorted, workspace;
  PointOrder order;
};

// Slices per bucket for a lookup of n points into a grid of r0 axis-0 slices of slice_bytes each, or 0
// for no reordering. kAuto: 0 for too few points to pay for the extra passes, a grid that fits in L2
// (fewer than 4 buckets of a quarter of L2 each) or a single slice larger than a bucket. kAlways:
// buckets of about 1/16 of axis 0, and the probe's verdict is ignored (ReorderMode: ../grid_reorder.h).
int64_t bucket_slices(int64_t n, int64_t r0, int64_t slice_bytes, ReorderMode mode);

// Queues the probe, count and scatter kernels for points (N, 3) (float32, float16 or bfloat16,
// contiguous, on the current device) on the current stream; `always` skips the probe's verdict. An
// empty order when slices == 0.
BucketedPoints bucket_points(const at::Tensor& points, int64_t r0, int64_t slices, bool always);

}  // namespace cuda_ext
