// Kernels that put the grid lookup's points in axis-0 bucket order; why and when:
// grid_interpolate_buckets.cuh.
#include "grid_interpolate_buckets.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <limits>

#include "grid_interpolate.h"  // sample_axis
#include "kernel_common.h"     // current_device_attribute

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBuckets = kThreads;  // the scatter kernel gives each bucket one thread
constexpr int kTilePoints = 2048;      // points one scatter block places
constexpr int kCountUnroll = 4;        // points per lane per step of the count kernel, for loads in flight
constexpr int kProbeWarps = 32, kProbeWindowsPerWarp = 4;  // the probe's 128 windows of 32 consecutive points
// Not tuned: on the H100 the count and scatter passes take 0.1 ms for 4M points and save 0.3 ms, so at
// about 1M points (and launch costs) the saving no longer clearly pays for them.
constexpr int64_t kMinPoints = int64_t(1) << 20;

// The workspace (int32): the probe's verdict, then points per bucket, then slots taken per bucket.
constexpr int kCoherent = 0, kCounts = 32, kCursors = kCounts + kMaxBuckets, kWorkspaceInts = kCursors + kMaxBuckets;

__device__ __forceinline__ int bucket_of(float x0, int64_t r0, int slices) {
  return static_cast<int>(sample_axis(x0, r0).lo / slices);
}

// One block: zeroes the counts and cursors, then counts neighbours in the same bucket inside 128 windows
// of 32 consecutive points spread over the array. Most of them alike: the points are coherent.
template <typename scalar_t>
__global__ void __launch_bounds__(kProbeWarps * 32)
    order_probe_kernel(const scalar_t* __restrict__ points, int64_t n, int64_t r0, int slices, bool always,
                       int* __restrict__ work) {
  __shared__ int same_total;
  if (threadIdx.x == 0) same_total = 0;
  for (int i = threadIdx.x; i < kWorkspaceInts - kCounts; i += blockDim.x) work[kCounts + i] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  constexpr int kWindows = kProbeWarps * kProbeWindowsPerWarp;
  int bucket[kProbeWindowsPerWarp];
#pragma unroll
  for (int u = 0; u < kProbeWindowsPerWarp; ++u) {
    const int64_t i = (warp * kProbeWindowsPerWarp + u) * (n / kWindows) + lane;
    bucket[u] = i < n ? bucket_of(static_cast<float>(points[3 * i]), r0, slices) : -1;
  }
  int same = 0;
#pragma unroll
  for (int u = 0; u < kProbeWindowsPerWarp; ++u) {
    const int previous = __shfl_up_sync(0xffffffffu, bucket[u], 1);
    same += lane > 0 && bucket[u] >= 0 && previous == bucket[u];
  }
  for (int d = 16; d > 0; d /= 2) same += __shfl_xor_sync(0xffffffffu, same, d);
  if (lane == 0) atomicAdd(&same_total, same);
  __syncthreads();
  if (threadIdx.x == 0) work[kCoherent] = !always && 2 * same_total > kWindows * 31;
}

// work[kCounts + b] = points in bucket b. A warp's lanes with one bucket add with one shared atomic.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) bucket_count_kernel(const scalar_t* __restrict__ points, int64_t n,
                                                                int64_t r0, int slices, int* __restrict__ work) {
  if (work[kCoherent]) return;
  __shared__ int hist[kMaxBuckets];
  hist[threadIdx.x] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t stride = int64_t(gridDim.x) * kThreads * kCountUnroll;
  // Each warp takes 32 * kCountUnroll consecutive points per step; the bounds are warp-uniform.
  for (int64_t first = (int64_t(blockIdx.x) * kThreads + threadIdx.x - lane) * kCountUnroll; first < n;
       first += stride) {
    int bucket[kCountUnroll];
#pragma unroll
    for (int u = 0; u < kCountUnroll; ++u) {
      const int64_t i = first + u * 32 + lane;
      bucket[u] = i < n ? bucket_of(static_cast<float>(points[3 * i]), r0, slices) : -1;
    }
#pragma unroll
    for (int u = 0; u < kCountUnroll; ++u) {
      const unsigned group = __match_any_sync(0xffffffffu, bucket[u]);
      if (bucket[u] >= 0 && lane == __ffs(group) - 1) atomicAdd(&hist[bucket[u]], __popc(group));
    }
  }
  __syncthreads();
  if (hist[threadIdx.x]) atomicAdd(work + kCounts + threadIdx.x, hist[threadIdx.x]);
}

// Each block places a tile of kTilePoints points: ranks inside the tile per bucket (a warp's points of one
// bucket stay together, in lane order, so runs along a ray survive), one global reservation per bucket,
// then the 16-byte writes sorted[slot] = (x, y, z, index).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    bucket_scatter_kernel(const scalar_t* __restrict__ points, int64_t n, int64_t r0, int slices,
                          int* __restrict__ work, float4* __restrict__ sorted) {
  if (work[kCoherent]) return;
  __shared__ int start[kMaxBuckets], tile_count[kMaxBuckets], warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // start[b] = points in the buckets before b: an exclusive scan of the counts, one bucket per thread.
  const int count = work[kCounts + threadIdx.x];
  int scan = count;
  for (int d = 1; d < 32; d *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, scan, d);
    if (lane >= d) scan += other;
  }
  if (lane == 31) warp_sums[warp] = scan;
  tile_count[threadIdx.x] = 0;
  __syncthreads();
  int before = 0;
  for (int w = 0; w < warp; ++w) before += warp_sums[w];
  start[threadIdx.x] = before + scan - count;

  constexpr int kPerThread = kTilePoints / kThreads;
  const int64_t tile = int64_t(blockIdx.x) * kTilePoints;
  float x[kPerThread][3];
  int bucket[kPerThread], rank[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = tile + j * kThreads + threadIdx.x;
    bucket[j] = -1;
    if (i < n) {
#pragma unroll
      for (int a = 0; a < 3; ++a) x[j][a] = static_cast<float>(points[3 * i + a]);
      bucket[j] = bucket_of(x[j][0], r0, slices);
    }
    const unsigned group = __match_any_sync(0xffffffffu, bucket[j]);
    const int leader = __ffs(group) - 1;
    int base = 0;
    if (bucket[j] >= 0 && lane == leader) base = atomicAdd(&tile_count[bucket[j]], __popc(group));
    rank[j] = __shfl_sync(0xffffffffu, base, leader) + __popc(group & ((1u << lane) - 1u));
  }
  __syncthreads();
  if (tile_count[threadIdx.x]) start[threadIdx.x] += atomicAdd(work + kCursors + threadIdx.x, tile_count[threadIdx.x]);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    if (bucket[j] < 0) continue;
    const int index = static_cast<int>(tile + j * kThreads + threadIdx.x);
    sorted[start[bucket[j]] + rank[j]] = make_float4(x[j][0], x[j][1], x[j][2], __int_as_float(index));
  }
}

template <typename scalar_t>
void launch_bucketing(const at::Tensor& points, int64_t r0, int slices, bool always, int* work, float4* sorted) {
  const int64_t n = points.size(0);
  const scalar_t* p = points.data_ptr<scalar_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int sms = current_device_attribute(cudaDevAttrMultiProcessorCount);
  order_probe_kernel<scalar_t><<<1, kProbeWarps * 32, 0, stream>>>(p, n, r0, slices, always, work);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  bucket_count_kernel<scalar_t><<<8 * sms, kThreads, 0, stream>>>(p, n, r0, slices, work);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t tiles = (n + kTilePoints - 1) / kTilePoints;  // n < 2^31 (bucket_slices), so this fits
  bucket_scatter_kernel<scalar_t>
      <<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(p, n, r0, slices, work, sorted);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

int64_t bucket_slices(int64_t n, int64_t r0, int64_t slice_bytes, ReorderMode mode) {
  // the index travels as an int; past that, or with nothing to reorder, the points' own order
  if (mode == ReorderMode::kOff || n <= 0 || n > std::numeric_limits<int>::max()) return 0;
  const int64_t cells = std::max<int64_t>(r0 - 1, 1);  // values a point's lower axis-0 index takes
  if (mode == ReorderMode::kAlways) return std::max<int64_t>(1, (cells + 15) / 16);
  if (n < kMinPoints || slice_bytes <= 0) return 0;  // before the device query: most lookups stop here
  const int64_t bucket_budget = current_device_attribute(cudaDevAttrL2CacheSize) / 4;
  if (slice_bytes > bucket_budget) return 0;
  const int64_t slices = std::max(bucket_budget / slice_bytes, (cells + kMaxBuckets - 1) / kMaxBuckets);
  return (cells + slices - 1) / slices >= 4 ? slices : 0;
}

BucketedPoints bucket_points(const at::Tensor& points, int64_t r0, int64_t slices, bool always) {
  BucketedPoints out;
  if (slices == 0) return out;
  out.workspace = at::empty({kWorkspaceInts}, points.options().dtype(at::kInt));
  out.sorted = at::empty({points.size(0), 4}, points.options().dtype(at::kFloat));  // fresh: 16-byte aligned
  int* work = out.workspace.data_ptr<int>();
  auto* sorted = reinterpret_cast<float4*>(out.sorted.data_ptr<float>());
  const int s = static_cast<int>(slices);
  switch (points.scalar_type()) {
    case at::kFloat: launch_bucketing<float>(points, r0, s, always, work, sorted); break;
    case at::kHalf: launch_bucketing<at::Half>(points, r0, s, always, work, sorted); break;
    case at::kBFloat16: launch_bucketing<at::BFloat16>(points, r0, s, always, work, sorted); break;
    default:
      TORCH_CHECK(false, "grid_interpolate: point reordering takes float32/16/bf16 points, got ", points.scalar_type());
  }
  out.order.sorted = sorted;
  out.order.coherent = work + kCoherent;
  return out;
}

}  // namespace cuda_ext
