// Per-ray scans of packed samples, one warp per ray (volume_render and distortion_loss): the warp's prefix sums,
// the exp / expm1 of both float types, and a ray's sample range with its offsets clamped to [0, N).
#pragma once

#include <cstdint>

namespace cuda_ext {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kAll = 0xffffffffu;

template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T x, int lane) {
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const T y = __shfl_up_sync(kAll, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// The sum of the lanes before this one, from warp_inclusive_scan's result: not inclusive - x, which cancels to
// noise when x is huge (a contracted march's last sample, s ~ 1e11) and would give that sample T ~ 1.
template <typename T>
__device__ __forceinline__ T warp_exclusive_from(T inclusive, int lane) {
  const T before = __shfl_up_sync(kAll, inclusive, 1);
  return lane == 0 ? T(0) : before;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) x += __shfl_xor_sync(kAll, x, d);
  return x;
}

// expf, not __expf: the op is memory-bound, and __expf's error grows with |x| (long, dense rays)
__device__ __forceinline__ float exp_of(float x) { return expf(x); }
__device__ __forceinline__ double exp_of(double x) { return exp(x); }
__device__ __forceinline__ float expm1_of(float x) { return expm1f(x); }
__device__ __forceinline__ double expm1_of(double x) { return expm1(x); }

struct RayRange {
  int64_t first, last;
};

__device__ __forceinline__ RayRange ray_range(const int64_t* offsets, int64_t b, int64_t n) {
  return {max(offsets[b], int64_t(0)), min(offsets[b + 1], n)};
}

}  // namespace
}  // namespace cuda_ext
