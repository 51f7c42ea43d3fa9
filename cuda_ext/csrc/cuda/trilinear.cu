// CUDA kernels of the trilinear family: the pairwise (N, 8, F) blend and the fused dense-grid
// lookup, forward and backward. float32/float64/float16/bfloat16, accumulation in float32 (float64
// for float64), 64-bit offsets throughout. Weight math and validation: ../trilinear.h.
//
// Pairwise op (memory bound, every byte read or written once): a group of G lanes (a power of two
// <= 32, inside one warp) owns a point and walks its F features in 16-byte vectors, G vectors
// apart, so each corner row is read with coalesced 16-byte loads and the point's weights are
// computed once per lane. The backward for feats is a pure streaming write (w_k * grad_out); the
// point gradient needs a reduction over F, done with shuffles inside the group in the same pass
// and written by lane 0: no atomics, no zero-fill.
//
// Grid op: a voxel's C channels are contiguous (channels-last), read with 4-channel vector loads.
// The forward gives each point a group of lanes that split its channels (no reduction across lanes),
// visiting the points in axis-0 bucket order when the grid is larger than L2 (point_buckets.cuh);
// the backward gives each point a quad of lanes that split its 8 voxels and scatters w_k * grad_out
// into grad_grid with atomics; see grid_backward_kernel for what limits it.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "ops.h"
#include "point_buckets.cuh"
#include "trilinear.h"
#include "vector_memory.cuh"

namespace cuda_ext {
namespace {

using namespace trilinear;

constexpr int kThreads = 256;

// ------------------------------------------------------------------------------ atomics and launch helpers

// dst[0..N) += value[0..N) atomically. Hopper (sm_90) has a 16-byte float4 atomic: one L2
// transaction instead of four.
template <typename acc_t, int N>
__device__ __forceinline__ void atomic_add_vec(acc_t* dst, const acc_t (&value)[N]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same<acc_t, float>::value && N == 4) {
    atomicAdd(reinterpret_cast<float4*>(dst), make_float4(value[0], value[1], value[2], value[3]));
  } else
#endif
  {
#pragma unroll
    for (int e = 0; e < N; ++e) atomicAdd(dst + e, value[e]);
  }
}

// Calls fn(std::integral_constant<int, VEC>) with VEC = kWide if `wide`, else 1.
template <int kWide, typename Fn>
void with_vector_width(bool wide, Fn&& fn) {
  if (wide) {
    fn(std::integral_constant<int, kWide>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

unsigned int block_count(int64_t threads, const char* op) {
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), op, ": too many points for one launch (", threads,
              " threads)");
  return static_cast<unsigned int>(blocks);
}

// ------------------------------------------------------------------------------ pairwise op

// Pairwise kernels move 16-byte vectors of features: 4 float, 8 half/bfloat16, 2 double.
template <typename scalar_t>
constexpr int kPairVec = 16 / static_cast<int>(sizeof(scalar_t));

// How lanes are assigned to points: 2^group_shift lanes per point.
struct PairLayout {
  int group_shift;
  unsigned int blocks;
};

PairLayout pair_layout(int64_t n_points, int64_t vectors_per_point, const char* op) {
  int shift = 0;
  while (shift < 5 && (int64_t(1) << shift) < vectors_per_point) ++shift;
  return {shift, block_count(n_points << shift, op)};
}

template <typename acc_t, typename scalar_t>
__device__ __forceinline__ void load_fractions(const scalar_t* __restrict__ point, acc_t t[3]) {
#pragma unroll
  for (int a = 0; a < 3; ++a) t[a] = local_fraction(static_cast<acc_t>(point[a]));
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    pair_forward_kernel(const scalar_t* __restrict__ feats, const scalar_t* __restrict__ points,
                        scalar_t* __restrict__ out, int64_t n_points, int64_t f, int group_shift) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> group_shift;
  if (n >= n_points) return;
  const int lane = threadIdx.x & ((1 << group_shift) - 1);
  acc_t t[3], w[8];
  load_fractions(points + 3 * n, t);
  pair_corner_weights(t[0], t[1], t[2], w);
  const scalar_t* corners = feats + n * 8 * f;
  scalar_t* row = out + n * f;
  for (int64_t j = int64_t(lane) * VEC; j < f; j += int64_t(VEC) << group_shift) {
    acc_t acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = acc_t(0);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      acc_t v[VEC];
      widen(load_vec<scalar_t, VEC, true>(corners + k * f + j), v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += w[k] * v[e];
    }
    store_vec(row + j, narrow<scalar_t>(acc));
  }
}

template <typename scalar_t, int VEC, bool kFeatsGrad, bool kPointsGrad>
__global__ void __launch_bounds__(kThreads)
    pair_backward_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ feats,
                         const scalar_t* __restrict__ points, scalar_t* __restrict__ grad_feats,
                         scalar_t* __restrict__ grad_points, int64_t n_points, int64_t f, int group_shift) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> group_shift;
  const bool active = n < n_points;
  // Lanes past the end stay for the group shuffles below (whole warps must take part).
  if (!kPointsGrad && !active) return;
  const int lane = threadIdx.x & ((1 << group_shift) - 1);
  acc_t t[3] = {acc_t(0), acc_t(0), acc_t(0)}, w[8];
  if (active) load_fractions(points + 3 * n, t);
  pair_corner_weights(t[0], t[1], t[2], w);
  acc_t dots[8];  // <grad_out, feats[n, k]> over this lane's features
#pragma unroll
  for (int k = 0; k < 8; ++k) dots[k] = acc_t(0);
  const int64_t end = active ? f : 0;
  for (int64_t j = int64_t(lane) * VEC; j < end; j += int64_t(VEC) << group_shift) {
    acc_t g[VEC];
    widen(load_vec<scalar_t, VEC, true>(grad_out + n * f + j), g);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (kFeatsGrad) {
        acc_t out[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = w[k] * g[e];
        store_vec(grad_feats + (n * 8 + k) * f + j, narrow<scalar_t>(out));
      }
      if (kPointsGrad) {
        acc_t v[VEC];
        widen(load_vec<scalar_t, VEC, true>(feats + (n * 8 + k) * f + j), v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dots[k] += g[e] * v[e];
      }
    }
  }
  if (kPointsGrad) {
    acc_t grad[3];
    pair_fraction_grads(t[0], t[1], t[2], dots, grad);  // linear in dots: reduce after combining
    const int group = 1 << group_shift;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      for (int offset = group / 2; offset > 0; offset /= 2) {
        grad[a] += __shfl_xor_sync(0xffffffffu, grad[a], offset, group);
      }
    }
    if (active && lane == 0) {
#pragma unroll
      for (int a = 0; a < 3; ++a) grad_points[3 * n + a] = static_cast<scalar_t>(grad[a] / acc_t(2));  // du/dx
    }
  }
}

// ------------------------------------------------------------------------------ grid op

// Grid kernels move 4 channels at a time (C % 4 == 0); 16 bytes for float32.
constexpr int kGridVec = 4;
// Backward: for C = 4, 8, 12, 16 (and 24, 32 below 8-byte types, whose rows would take too many
// registers) the channel count is a template argument, so the loop over channels unrolls and a lane's
// atomics and gathers are all in flight together.
// Calls fn(integral_constant<int, V>) with V = channels / VEC when VEC == kGridVec and that is one of
// those counts, else V = 0 (channel count known at run time only).
template <typename scalar_t, int VEC, typename Fn>
void with_channel_vectors(int64_t channels, Fn&& fn) {
  if constexpr (VEC == kGridVec) {
    switch (channels / VEC) {
      case 1: return fn(std::integral_constant<int, 1>{});
      case 2: return fn(std::integral_constant<int, 2>{});
      case 3: return fn(std::integral_constant<int, 3>{});
      case 4: return fn(std::integral_constant<int, 4>{});
      default: break;
    }
    if constexpr (sizeof(scalar_t) <= 4) {
      if (channels / VEC == 6) return fn(std::integral_constant<int, 6>{});
      if (channels / VEC == 8) return fn(std::integral_constant<int, 8>{});
    }
  }
  fn(std::integral_constant<int, 0>{});
}

struct GridDims {
  int64_t r0, r1, r2, channels;
};

GridDims grid_dims(const at::Tensor& grid) { return {grid.size(0), grid.size(1), grid.size(2), grid.size(3)}; }

// Backward: a point's 8 voxels are split over a quad of 4 consecutive lanes: lane q owns the two
// voxels (b1, b2) = (q >> 1, q & 1) at b0 = 0 ("lo") and b0 = 1 ("hi"), neighbours along axis 0. So
// in each atomic or load instruction lanes 2m and 2m+1 touch the two voxels that are adjacent in
// memory (along axis 2), usually in the same 128-byte line. Four lanes per point also quadruple the
// independent atomics in flight; the point gradient gathers the 8 corner dot products with shuffles.
// (This layout was the forward's too until the channel split below beat it: bench/README.md.)
constexpr int kQuad = 4;

template <typename acc_t>
struct VoxelPair {
  int64_t offset_lo, offset_hi;  // element offsets of channel 0 of the lane's voxel at b0 = 0 / b0 = 1
  acc_t weight_lo, weight_hi;
  AxisSample<acc_t> axis[3];
};

template <typename acc_t, typename scalar_t>
__device__ __forceinline__ VoxelPair<acc_t> locate_pair(const scalar_t* __restrict__ point, const GridDims& d,
                                                         int q) {
  VoxelPair<acc_t> pair;
  pair.axis[0] = sample_axis(static_cast<acc_t>(point[0]), d.r0);
  pair.axis[1] = sample_axis(static_cast<acc_t>(point[1]), d.r1);
  pair.axis[2] = sample_axis(static_cast<acc_t>(point[2]), d.r2);
  const AxisSample<acc_t>&a0 = pair.axis[0], &a1 = pair.axis[1], &a2 = pair.axis[2];
  const bool b1 = q & 2, b2 = q & 1;
  const int64_t inner = (b1 ? a1.hi : a1.lo) * d.r2 + (b2 ? a2.hi : a2.lo);  // offset inside an axis-0 slice
  const int64_t slice = d.r1 * d.r2;
  pair.offset_lo = (a0.lo * slice + inner) * d.channels;
  pair.offset_hi = (a0.hi * slice + inner) * d.channels;
  const acc_t w12 = (b1 ? a1.t : acc_t(1) - a1.t) * (b2 ? a2.t : acc_t(1) - a2.t);
  pair.weight_lo = w12 * (acc_t(1) - a0.t);
  pair.weight_hi = w12 * a0.t;
  return pair;
}

// Forward: a group of G = min(C / VEC, 4) lanes per point, lane g blending channel vectors g, g + G, ...
// of all 8 voxels. No lane-to-lane reduction is needed, each load instruction of a group reads one
// voxel's contiguous channels, and the warp's output rows go out in one store instruction. H100,
// 160^3 x 12 (G = 3, 10 points per warp), 4M points, against the quad layout the backward keeps: op
// benchmark random 0.902 -> 0.904 ms (DRAM-bound either way), sorted along rays 0.259 -> 0.221 ms.
template <typename acc_t>
struct CornerFrame {  // the 8 voxels as corner 0's offset, one step and one fraction per axis: few registers
  int64_t base, step[3];
  acc_t t[3];
  __device__ __forceinline__ int64_t step_to(int k) const {  // corner k's offset - corner 0's
    return ((k & 4) ? step[0] : 0) + ((k & 2) ? step[1] : 0) + ((k & 1) ? step[2] : 0);
  }
  __device__ __forceinline__ acc_t weight(int k) const {  // corner_weights(t, .)[k], recomputed: cheaper than 8 registers
    return ((k & 4) ? t[0] : acc_t(1) - t[0]) * ((k & 2) ? t[1] : acc_t(1) - t[1]) * ((k & 1) ? t[2] : acc_t(1) - t[2]);
  }
};

template <typename acc_t>
__device__ __forceinline__ CornerFrame<acc_t> locate_corners(acc_t x0, acc_t x1, acc_t x2, const GridDims& d) {
  const AxisSample<acc_t> a0 = sample_axis(x0, d.r0), a1 = sample_axis(x1, d.r1), a2 = sample_axis(x2, d.r2);
  const int64_t row = d.r2 * d.channels, slice = d.r1 * row;
  CornerFrame<acc_t> c;
  c.base = a0.lo * slice + a1.lo * row + a2.lo * d.channels;
  c.step[0] = (a0.hi - a0.lo) * slice;
  c.step[1] = (a1.hi - a1.lo) * row;
  c.step[2] = (a2.hi - a2.lo) * d.channels;
  c.t[0] = a0.t;
  c.t[1] = a1.t;
  c.t[2] = a2.t;
  return c;
}

// Blends channel vector v (channels v * VEC ...) of the 8 corners into out_row.
template <typename scalar_t, typename acc_t, int VEC>
__device__ __forceinline__ void blend_corners(const scalar_t* __restrict__ grid, const CornerFrame<acc_t>& c,
                                              int64_t v, scalar_t* __restrict__ out_row) {
  const scalar_t* corner0 = grid + c.base + v * VEC;
  // All 8 gathers are issued before the blend as far as registers allow: at float32's 32-register
  // budget ptxas issues them in steps (2, 1, 1, 4). Variants with all 8 in flight (float2 or float
  // lanes, or 64 registers) ran no faster on the H100: the lookup is bound by DRAM and L2, not latency.
  Vec<scalar_t, VEC> corner[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) corner[k] = load_vec<scalar_t, VEC, false>(corner0 + c.step_to(k));
  acc_t acc[VEC] = {};
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    acc_t value[VEC];
    widen(corner[k], value);
    const acc_t w = c.weight(k);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] += w * value[e];
  }
  store_vec(out_row + v * VEC, narrow<scalar_t>(acc));
}

// One pass: 8 resident blocks (32 registers) measured best for float32 on the H100 (0.894 ms against
// 0.920 for 6); double needs the registers of 4. The loop over channel vectors needs more registers.
template <typename scalar_t, bool kOnePass>
constexpr int kGridForwardMinBlocks = (sizeof(at::opmath_type<scalar_t>) == 8 ? 4 : 8) / (kOnePass ? 1 : 2);

// kOnePass: the group has one lane per channel vector (C / VEC <= 4), so no loop over channels.
// kOrdered: slot i is point i, unless `order` holds a bucket order (point_buckets.cuh): then it is the
// point stored there. A template argument, so lookups that never reorder keep the plain kernel.
template <typename scalar_t, int VEC, int kGroup, bool kOnePass, bool kOrdered>
__global__ void __launch_bounds__(kThreads, (kGridForwardMinBlocks<scalar_t, kOnePass>))
    grid_forward_kernel(const scalar_t* __restrict__ grid, const scalar_t* __restrict__ points, PointOrder order,
                        scalar_t* __restrict__ out, int64_t n_points, GridDims d) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kPointsPerWarp = 32 / kGroup;  // G = 3 leaves lanes 30 and 31 idle
  const int lane = threadIdx.x % 32, g = lane % kGroup;
  const int64_t slot = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32 * kPointsPerWarp + lane / kGroup;
  if (lane >= kPointsPerWarp * kGroup || slot >= n_points) return;
  CornerFrame<acc_t> c;
  scalar_t* out_row;
  if (kOrdered && order.bucketed()) {  // warp-uniform
    const float4 entry = __ldcs(order.sorted + slot);
    c = locate_corners<acc_t>(entry.x, entry.y, entry.z, d);
    out_row = out + int64_t(__float_as_int(entry.w)) * d.channels;
  } else {
    const scalar_t* point = points + 3 * slot;
    c = locate_corners<acc_t>(static_cast<acc_t>(point[0]), static_cast<acc_t>(point[1]), static_cast<acc_t>(point[2]), d);
    out_row = out + slot * d.channels;
  }
  if constexpr (kOnePass) {
    blend_corners<scalar_t, acc_t, VEC>(grid, c, g, out_row);
  } else {
    // Not unrolled: the compiler's own unrolling of the scalar (VEC = 1) path spilled 36 bytes at this
    // launch bound and ran 1.4x slower (H100, C = 5 to 7: bench/README.md).
#pragma unroll 1
    for (int64_t v = g; v < d.channels / VEC; v += kGroup) blend_corners<scalar_t, acc_t, VEC>(grid, c, v, out_row);
  }
}

// Calls fn(integral_constant<int, G>) for a lane group of G in 1..4.
template <typename Fn>
void with_lane_group(int64_t group, Fn&& fn) {
  switch (group) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

// Merges the atomics of consecutive points that fall in the same grid cell. Lane L = 4p + q of a
// warp serves point p and voxel pair q (the quad layout); a column q holds the 8 points' pairs q.
// Points sorted along rays often put several consecutive samples in one cell, and their adds to the
// same voxels serialise in L2; here each run of equal targets in a column is summed with shuffles
// and only its first lane (the head) issues the atomics. Random points almost never share a cell:
// their warps see no run and skip the shuffles (one ballot decides, warp-uniform).
struct CellRuns {
  unsigned run_end = 32;   // first lane after this lane's run in its column (32: the warp's end)
  bool head = true;        // this lane issues the run's atomics
  bool any_merge = false;  // some lane of the warp has a run longer than one point (same for all lanes)

  CellRuns() = default;  // no runs: for a backward that issues no atomics, so skips the warp-wide step

  // offset_lo identifies the target (equal offset_lo => same a0.lo and voxel => equal offset_hi).
  // Inactive lanes (past the last point) are heads of their own run, so nothing merges into them.
  __device__ __forceinline__ CellRuns(int64_t offset_lo, bool active) {
    const int lane = threadIdx.x % 32;
    const int64_t previous = __shfl_up_sync(0xffffffffu, offset_lo, kQuad);
    head = !active || lane < kQuad || previous != offset_lo;
    const unsigned heads = __ballot_sync(0xffffffffu, head);
    any_merge = heads != 0xffffffffu;
    const unsigned column = 0x11111111u << (lane % kQuad);
    const unsigned later_heads = heads & column & ~((2u << lane) - 1u);  // lane's column, above lane
    run_end = later_heads ? __ffs(later_heads) - 1 : 32;
  }

  // v becomes the sum of v over the lanes from this one to the end of its run (the head: the run).
  template <typename acc_t, int N>
  __device__ __forceinline__ void sum_to_head(acc_t (&v)[N]) const {
    const unsigned lane = threadIdx.x % 32;
#pragma unroll
    for (int d = kQuad; d < 32; d *= 2) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const acc_t later = __shfl_down_sync(0xffffffffu, v[e], d);
        if (lane + d < run_end) v[e] += later;
      }
    }
  }
};

// What limits this kernel: grad_grid receives 8 * C atomic adds per point at random addresses. On
// Hopper these are fire-and-forget reductions (RED) executed in L2; with random points nearly every
// one misses L2 (the grid is larger than it), so the cost is DRAM traffic for the sectors they touch
// (read and written back) plus the number of atomic transactions. What we do: fp32 (and the fp32
// buffer used for half/bfloat16) adds 4 channels per float4 atomic on sm_90 (a quarter of the
// transactions); the 8 voxels are split over a quad of lanes, so 4x more reductions are issued in
// parallel; each point's grad_out row is read once per lane (one request per quad) and its weights
// computed once. Points sorted along rays hit L2, but consecutive samples in one cell add to the same
// voxels, which serialises in L2: CellRuns sums such runs inside the warp first.
template <typename scalar_t, int VEC, int kChannelVecs, bool kGridGrad, bool kPointsGrad>
__global__ void __launch_bounds__(kThreads)
    grid_backward_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ grid,
                         const scalar_t* __restrict__ points, at::opmath_type<scalar_t>* __restrict__ grad_grid,
                         scalar_t* __restrict__ grad_points, int64_t n_points, GridDims d) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int q = static_cast<int>(thread % kQuad);
  const bool active = thread / kQuad < n_points;
  // Lanes past the end take part in the warp's shuffles on a copy of the last point, writing nothing.
  const int64_t n = active ? thread / kQuad : n_points - 1;
  const int64_t channels = kChannelVecs > 0 ? int64_t(kChannelVecs) * VEC : d.channels;
  // With the channel count known at compile time, the grad_out row is loaded first: its loads are
  // then in flight with the point's, not held back behind CellRuns' shuffles and the branch below
  // (H100, random points, grid gradient: 3.34 ms loading it inside the loop, 2.97 ms like this).
  Vec<scalar_t, VEC> grad_row[kChannelVecs > 0 ? kChannelVecs : 1];
  if constexpr (kChannelVecs > 0) {
#pragma unroll
    for (int c = 0; c < kChannelVecs; ++c) {
      grad_row[c] = load_vec<scalar_t, VEC, false>(grad_out + n * channels + c * VEC);
    }
  }
  const VoxelPair<acc_t> pair = locate_pair<acc_t>(points + 3 * n, d, q);
  const CellRuns runs = kGridGrad ? CellRuns(pair.offset_lo, active) : CellRuns();
  acc_t dot_lo = acc_t(0), dot_hi = acc_t(0);  // <grad_out[n], voxel> for the lane's two voxels
  // Two copies of the channel loop, chosen once per warp, so the common case (no runs) has no
  // shuffles and no branch inside.
  const auto channel_loop = [&](auto merge_runs) {
#pragma unroll
    for (int64_t j = 0; j < channels; j += VEC) {
      acc_t g[VEC];
      if constexpr (kChannelVecs > 0) {
        widen(grad_row[j / VEC], g);
      } else {
        widen(load_vec<scalar_t, VEC, false>(grad_out + n * channels + j), g);
      }
      if (kGridGrad) {
        acc_t add_lo[VEC], add_hi[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          add_lo[e] = pair.weight_lo * g[e];
          add_hi[e] = pair.weight_hi * g[e];
        }
        if constexpr (decltype(merge_runs)::value) {
          runs.sum_to_head(add_lo);
          runs.sum_to_head(add_hi);
        }
        if (active && runs.head) {  // without runs every active lane is a head
          atomic_add_vec(grad_grid + pair.offset_lo + j, add_lo);
          atomic_add_vec(grad_grid + pair.offset_hi + j, add_hi);
        }
      }
      if (kPointsGrad) {
        acc_t vlo[VEC], vhi[VEC];
        widen(load_vec<scalar_t, VEC, false>(grid + pair.offset_lo + j), vlo);
        widen(load_vec<scalar_t, VEC, false>(grid + pair.offset_hi + j), vhi);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          dot_lo += g[e] * vlo[e];
          dot_hi += g[e] * vhi[e];
        }
      }
    }
  };
  if (kGridGrad && runs.any_merge) {
    channel_loop(std::true_type{});
  } else {
    channel_loop(std::false_type{});
  }
  if (kPointsGrad) {
    acc_t dots[8];  // corner k = 4*b0 + 2*b1 + b2 lives in lane k%4 of the quad, as its lo (b0=0) or hi
#pragma unroll
    for (int k = 0; k < 8; ++k) dots[k] = __shfl_sync(0xffffffffu, (k & 4) ? dot_hi : dot_lo, k & 3, kQuad);
    if (active && q == 0) {
      const AxisSample<acc_t>*a = pair.axis;
      acc_t grad[3];
      fraction_grads(a[0].t, a[1].t, a[2].t, dots, grad);
#pragma unroll
      for (int i = 0; i < 3; ++i) grad_points[3 * n + i] = static_cast<scalar_t>(grad[i] * a[i].dt_dx);
    }
  }
}

// Calls fn(bool_constant<A>, bool_constant<B>) for the runtime pair (a, b), not both false.
template <typename Fn>
void with_gradient_flags(bool a, bool b, Fn&& fn) {
  if (a && b) {
    fn(std::true_type{}, std::true_type{});
  } else if (a) {
    fn(std::true_type{}, std::false_type{});
  } else {
    fn(std::false_type{}, std::true_type{});
  }
}

at::Tensor no_grad_placeholder(const at::Tensor& like) { return at::empty({0}, like.options()); }

}  // namespace

// ------------------------------------------------------------------------------ entry points

at::Tensor trilinear_interpolate_cuda(const at::Tensor& feats_in, const at::Tensor& points_in) {
  const char* op = "trilinear_interpolate";
  check_pair_inputs(feats_in, points_in, at::kCUDA, op);
  const c10::cuda::CUDAGuard guard(feats_in.device());
  const at::Tensor feats = feats_in.contiguous(), points = points_in.contiguous();
  const int64_t n = feats.size(0), f = feats.size(2);
  at::Tensor out = at::empty({n, f}, feats.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, feats.scalar_type(), "trilinear_interpolate_cuda", [&] {
    constexpr int kVec = kPairVec<scalar_t>;
    const scalar_t* feats_ptr = feats.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const bool wide = f % kVec == 0 && aligned_to(feats_ptr, 16) && aligned_to(out_ptr, 16);
    with_vector_width<kVec>(wide, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const PairLayout layout = pair_layout(n, f / VEC + (f % VEC != 0), op);
      pair_forward_kernel<scalar_t, VEC><<<layout.blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          feats_ptr, points.data_ptr<scalar_t>(), out_ptr, n, f, layout.group_shift);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> trilinear_interpolate_backward_cuda(const at::Tensor& grad_out_in,
                                                                      const at::Tensor& feats_in,
                                                                      const at::Tensor& points_in,
                                                                      bool feats_requires_grad,
                                                                      bool points_requires_grad) {
  const char* op = "trilinear_interpolate_backward";
  check_pair_inputs(feats_in, points_in, at::kCUDA, op);
  const int64_t n = feats_in.size(0), f = feats_in.size(2);
  check_grad_out(grad_out_in, n, f, feats_in, "feats", op);
  const c10::cuda::CUDAGuard guard(feats_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous(), feats = feats_in.contiguous(), points = points_in.contiguous();
  at::Tensor grad_feats = feats_requires_grad ? at::empty({n, 8, f}, feats.options()) : no_grad_placeholder(feats);
  at::Tensor grad_points = points_requires_grad ? at::empty({n, 3}, points.options()) : no_grad_placeholder(points);
  if (points_requires_grad && f == 0) grad_points.zero_();  // no features: the gradient is exactly 0
  if (n == 0 || f == 0 || !(feats_requires_grad || points_requires_grad)) return {grad_feats, grad_points};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, feats.scalar_type(), "trilinear_interpolate_backward_cuda", [&] {
        constexpr int kVec = kPairVec<scalar_t>;
        const scalar_t* grad_out_ptr = grad_out.data_ptr<scalar_t>();
        const scalar_t* feats_ptr = feats.data_ptr<scalar_t>();
        scalar_t* grad_feats_ptr = feats_requires_grad ? grad_feats.data_ptr<scalar_t>() : nullptr;
        scalar_t* grad_points_ptr = points_requires_grad ? grad_points.data_ptr<scalar_t>() : nullptr;
        const bool wide = f % kVec == 0 && aligned_to(grad_out_ptr, 16) && aligned_to(feats_ptr, 16) &&
                          aligned_to(grad_feats_ptr, 16);  // nullptr counts as aligned
        with_vector_width<kVec>(wide, [&](auto vec) {
          constexpr int VEC = decltype(vec)::value;
          const PairLayout layout = pair_layout(n, f / VEC + (f % VEC != 0), op);
          with_gradient_flags(feats_requires_grad, points_requires_grad, [&](auto feats_grad, auto points_grad) {
            pair_backward_kernel<scalar_t, VEC, decltype(feats_grad)::value, decltype(points_grad)::value>
                <<<layout.blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                    grad_out_ptr, feats_ptr, points.data_ptr<scalar_t>(), grad_feats_ptr, grad_points_ptr, n, f,
                    layout.group_shift);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        });
      });
  return {grad_feats, grad_points};
}

at::Tensor grid_interpolate_cuda(const at::Tensor& grid_in, const at::Tensor& points_in) {
  const char* op = "grid_interpolate";
  check_grid_inputs(grid_in, points_in, at::kCUDA, op);
  const c10::cuda::CUDAGuard guard(grid_in.device());
  const at::Tensor grid = grid_in.contiguous(), points = points_in.contiguous();
  const int64_t n = points.size(0), channels = grid.size(3);
  at::Tensor out = at::empty({n, channels}, grid.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grid.scalar_type(), "grid_interpolate_cuda", [&] {
    // Large grids: visit the points in axis-0 bucket order (point_buckets.cuh). Only where the
    // accumulation type is float, since the reordered points are stored as floats.
    constexpr bool kReorderable = std::is_same<at::opmath_type<scalar_t>, float>::value;
    const ReorderMode mode = reorder_mode(op);
    const int64_t slices = kReorderable
        ? bucket_slices(n, grid.size(0), grid.size(1) * grid.size(2) * channels * int64_t(sizeof(scalar_t)), mode)
        : 0;
    const BucketedPoints bucketed = bucket_points(points, grid.size(0), slices, mode == ReorderMode::kAlways);
    const scalar_t* grid_ptr = grid.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t vec_bytes = kGridVec * sizeof(scalar_t);
    const bool wide = channels % kGridVec == 0 && aligned_to(grid_ptr, vec_bytes) && aligned_to(out_ptr, vec_bytes);
    with_vector_width<kGridVec>(wide, [&](auto vec) {
      constexpr int VEC = decltype(vec)::value;
      const int64_t vecs = channels / VEC;
      with_lane_group(vecs < 4 ? vecs : 4, [&](auto group) {
        constexpr int kGroup = decltype(group)::value;
        const int64_t warps = (n + 32 / kGroup - 1) / (32 / kGroup);
        const auto launch = [&](auto one_pass) {
          constexpr bool kOnePass = decltype(one_pass)::value;
          const auto run = [&](auto kernel) {
            kernel<<<block_count(32 * warps, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                grid_ptr, points.data_ptr<scalar_t>(), bucketed.order, out_ptr, n, grid_dims(grid));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          };
          if constexpr (kReorderable) {
            if (bucketed.order.sorted != nullptr) return run(grid_forward_kernel<scalar_t, VEC, kGroup, kOnePass, true>);
          }
          run(grid_forward_kernel<scalar_t, VEC, kGroup, kOnePass, false>);
        };
        if constexpr (kGroup == 4) {  // only a full group can have more channel vectors than lanes
          if (vecs > kGroup) return launch(std::false_type{});
        }
        launch(std::true_type{});
      });
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> grid_interpolate_backward_cuda(const at::Tensor& grad_out_in,
                                                                 const at::Tensor& grid_in,
                                                                 const at::Tensor& points_in, bool grid_requires_grad,
                                                                 bool points_requires_grad) {
  const char* op = "grid_interpolate_backward";
  check_grid_inputs(grid_in, points_in, at::kCUDA, op);
  const int64_t n = points_in.size(0), channels = grid_in.size(3);
  check_grad_out(grad_out_in, n, channels, grid_in, "grid", op);
  const c10::cuda::CUDAGuard guard(grid_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous(), grid = grid_in.contiguous(), points = points_in.contiguous();
  // Atomics accumulate in float32 for half/bfloat16 (then cast), in place for float32/float64.
  const auto acc_dtype = at::toOpMathType(grid.scalar_type());
  at::Tensor grad_acc = grid_requires_grad ? at::zeros(grid.sizes(), grid.options().dtype(acc_dtype))
                                           : no_grad_placeholder(grid);
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  if (grad_out.numel() > 0 && (grid_requires_grad || points_requires_grad)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grid.scalar_type(), "grid_interpolate_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const scalar_t* grad_out_ptr = grad_out.data_ptr<scalar_t>();
          const scalar_t* grid_ptr = grid.data_ptr<scalar_t>();
          const int64_t vec_bytes = kGridVec * sizeof(scalar_t);
          // grad_acc is a fresh allocation: aligned for any vector width.
          const bool wide =
              channels % kGridVec == 0 && aligned_to(grad_out_ptr, vec_bytes) && aligned_to(grid_ptr, vec_bytes);
          acc_t* grad_acc_ptr = grid_requires_grad ? grad_acc.data_ptr<acc_t>() : nullptr;
          scalar_t* grad_points_ptr = points_requires_grad ? grad_points.data_ptr<scalar_t>() : nullptr;
          with_vector_width<kGridVec>(wide, [&](auto vec) {
            constexpr int VEC = decltype(vec)::value;
            with_channel_vectors<scalar_t, VEC>(channels, [&](auto channel_vecs) {
              with_gradient_flags(grid_requires_grad, points_requires_grad, [&](auto grid_grad, auto points_grad) {
                grid_backward_kernel<scalar_t, VEC, decltype(channel_vecs)::value, decltype(grid_grad)::value,
                                     decltype(points_grad)::value>
                    <<<block_count(kQuad * n, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                        grad_out_ptr, grid_ptr, points.data_ptr<scalar_t>(), grad_acc_ptr, grad_points_ptr, n,
                        grid_dims(grid));
                C10_CUDA_KERNEL_LAUNCH_CHECK();
              });
            });
          });
        });
  }
  at::Tensor grad_grid = grid_requires_grad && acc_dtype != grid.scalar_type() ? grad_acc.to(grid.scalar_type())
                                                                                : grad_acc;
  return {grad_grid, grad_points};
}

}  // namespace cuda_ext
