// CUDA backward of the grid lookup grid_interpolate: grad_grid by scattered atomics and grad_points from
// the 8 voxels' dot products with grad_out. Same dtypes and accumulation as the forward
// (grid_interpolate.cu); geometry, weights and validation: ../grid_interpolate.h.
//
// Each point gets a quad of lanes that split its 8 voxels and scatter w_k * grad_out into grad_grid with
// atomics; see grid_backward_kernel for what limits it.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <type_traits>

#include "grid_interpolate.h"
#include "kernel_common.h"
#include "ops.h"
#include "vector_memory.cuh"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;

// For C = 4, 8, 12, 16 (and 24, 32 below 8-byte types, whose rows would take too many registers) the
// channel count is a template argument, so the loop over channels unrolls and a lane's atomics and gathers
// are all in flight together.
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

// A point's 8 voxels are split over a quad of 4 consecutive lanes: lane q owns the two voxels
// (b1, b2) = (q >> 1, q & 1) at b0 = 0 ("lo") and b0 = 1 ("hi"), neighbours along axis 0. So in each
// atomic or load instruction lanes 2m and 2m+1 touch the two voxels that are adjacent in memory (along
// axis 2), usually in the same 128-byte line. Four lanes per point also quadruple the
// independent atomics in flight; the point gradient gathers the 8 corner dot products with shuffles.
// (This layout was the forward's too until the channel split beat it: bench/README.md.)
constexpr int kQuad = 4;

// The two voxels of a point that lane q of its quad owns. Not GridCorners: a lane holds just its 2 voxels,
// weighted with corner_weights' grouping of the products (GridCorners::weight groups them otherwise).
template <typename acc_t>
struct LaneVoxelPair {
  int64_t offset_lo, offset_hi;  // element offsets of channel 0 of the lane's voxel at b0 = 0 / b0 = 1
  acc_t weight_lo, weight_hi;
  AxisSample<acc_t> axis[3];
};

template <typename acc_t, typename scalar_t>
__device__ __forceinline__ LaneVoxelPair<acc_t> locate_lane_pair(const scalar_t* __restrict__ point, const GridShape& d,
                                                                 int q) {
  LaneVoxelPair<acc_t> pair;
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
                         scalar_t* __restrict__ grad_points, int64_t n_points, GridShape d) {
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
  const LaneVoxelPair<acc_t> pair = locate_lane_pair<acc_t>(points + 3 * n, d, q);
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
      const AxisSample<acc_t>* a = pair.axis;
      acc_t grad[3];
      fraction_grads(a[0].t, a[1].t, a[2].t, dots, grad);
#pragma unroll
      for (int i = 0; i < 3; ++i) grad_points[3 * n + i] = static_cast<scalar_t>(grad[i] * a[i].dt_dx);
    }
  }
}

}  // namespace

// ------------------------------------------------------------------------------ entry point

std::tuple<at::Tensor, at::Tensor> grid_interpolate_backward_cuda(const at::Tensor& grad_out_in,
                                                                  const at::Tensor& grid_in,
                                                                  const at::Tensor& points_in, bool grid_requires_grad,
                                                                  bool points_requires_grad,
                                                                  const std::optional<at::Tensor>& grad_into) {
  const char* op = "grid_interpolate_backward";
  check_grid_inputs(grid_in, points_in, at::kCUDA, op);
  const int64_t n = points_in.size(0), channels = grid_in.size(3);
  check_grad_out(grad_out_in, n, channels, grid_in, "grid", op);
  const c10::cuda::CUDAGuard guard(grid_in.device());
  const at::Tensor grad_out = grad_out_in.contiguous(), grid = grid_in.contiguous(), points = points_in.contiguous();
  // Atomics accumulate in float32 for half/bfloat16 (then cast), in place for float32/float64.
  const auto acc_dtype = at::toOpMathType(grid.scalar_type());
  at::Tensor grad_acc = lookup_grad_target(grid, grad_into, grid_requires_grad, "grid", op);
  at::Tensor grad_points = points_requires_grad ? at::zeros({n, 3}, points.options()) : no_grad_placeholder(points);
  if (grad_out.numel() > 0 && (grid_requires_grad || points_requires_grad)) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grid.scalar_type(), "grid_interpolate_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const scalar_t* grad_out_ptr = grad_out.data_ptr<scalar_t>();
          const scalar_t* grid_ptr = grid.data_ptr<scalar_t>();
          const int64_t vec_bytes = kGridVec * sizeof(scalar_t);
          acc_t* grad_acc_ptr = grid_requires_grad ? grad_acc.data_ptr<acc_t>() : nullptr;
          const bool wide = channels % kGridVec == 0 && aligned_to(grad_out_ptr, vec_bytes) &&
                            aligned_to(grid_ptr, vec_bytes) &&
                            (grad_acc_ptr == nullptr || aligned_to(grad_acc_ptr, kGridVec * sizeof(acc_t)));
          scalar_t* grad_points_ptr = points_requires_grad ? grad_points.data_ptr<scalar_t>() : nullptr;
          with_vector_width<kGridVec>(wide, [&](auto vec) {
            constexpr int VEC = decltype(vec)::value;
            with_channel_vectors<scalar_t, VEC>(channels, [&](auto channel_vecs) {
              with_gradient_flags(grid_requires_grad, points_requires_grad, [&](auto grid_grad, auto points_grad) {
                grid_backward_kernel<scalar_t, VEC, decltype(channel_vecs)::value, decltype(grid_grad)::value,
                                     decltype(points_grad)::value>
                    <<<block_count(kQuad * n, kThreads, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                        grad_out_ptr, grid_ptr, points.data_ptr<scalar_t>(), grad_acc_ptr, grad_points_ptr, n,
                        grid_shape(grid));
                C10_CUDA_KERNEL_LAUNCH_CHECK();
              });
            });
          });
        });
  }
  if (grad_into) return {no_grad_placeholder(grid), grad_points};  // added onto the caller's tensor
  at::Tensor grad_grid =
      grid_requires_grad && acc_dtype != grid.scalar_type() ? grad_acc.to(grid.scalar_type()) : grad_acc;
  return {grad_grid, grad_points};
}

}  // namespace cuda_ext
