// CUDA forward of the grid lookup grid_interpolate: a channels-last (R0, R1, R2, C) grid read at (N, 3)
// points. float32/float64/float16/bfloat16, accumulation in float32 (float64 for float64), 64-bit offsets
// throughout. Geometry, weights and validation: ../grid_interpolate.h; the backward:
// grid_interpolate_backward.cu.
//
// A voxel's C channels are contiguous (channels-last), read with 4-channel vector loads. Each point gets a
// group of lanes that split its channels (no reduction across lanes), and the points are visited in axis-0
// bucket order when the grid is larger than L2 (grid_interpolate_buckets.cuh).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <type_traits>

#include "grid_interpolate.h"
#include "grid_interpolate_buckets.cuh"
#include "grid_reorder.h"
#include "kernel_common.h"
#include "ops.h"
#include "vector_memory.cuh"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;

// Blends channel vector v (channels v * VEC ...) of the 8 corners into out_row.
template <typename scalar_t, typename acc_t, int VEC>
__device__ __forceinline__ void blend_corners(const scalar_t* __restrict__ grid, const GridCorners<acc_t>& c, int64_t v,
                                              scalar_t* __restrict__ out_row) {
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

// A group of G = min(C / VEC, 4) lanes per point, lane g blending channel vectors g, g + G, ... of all 8
// voxels. No lane-to-lane reduction is needed, each load instruction of a group reads one voxel's
// contiguous channels, and the warp's output rows go out in one store instruction. H100, 160^3 x 12
// (G = 3, 10 points per warp), 4M points, against the quad layout the backward keeps: op benchmark random
// 0.902 -> 0.904 ms (DRAM-bound either way), sorted along rays 0.259 -> 0.221 ms.
// kOnePass: the group has one lane per channel vector (C / VEC <= 4), so no loop over channels.
// kOrdered: slot i is point i, unless `order` holds a bucket order (grid_interpolate_buckets.cuh): then it is the
// point stored there. A template argument, so lookups that never reorder keep the plain kernel.
template <typename scalar_t, int VEC, int kGroup, bool kOnePass, bool kOrdered>
__global__ void __launch_bounds__(kThreads, (kGridForwardMinBlocks<scalar_t, kOnePass>))
    grid_forward_kernel(const scalar_t* __restrict__ grid, const scalar_t* __restrict__ points, PointOrder order,
                        scalar_t* __restrict__ out, int64_t n_points, GridShape d) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kPointsPerWarp = 32 / kGroup;  // G = 3 leaves lanes 30 and 31 idle
  const int lane = threadIdx.x % 32, g = lane % kGroup;
  const int64_t slot = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32 * kPointsPerWarp + lane / kGroup;
  if (lane >= kPointsPerWarp * kGroup || slot >= n_points) return;
  GridCorners<acc_t> c;
  scalar_t* out_row;
  if (kOrdered && order.bucketed()) {  // warp-uniform
    const float4 entry = __ldcs(order.sorted + slot);
    c = locate_corners<acc_t>(entry.x, entry.y, entry.z, d);
    out_row = out + int64_t(__float_as_int(entry.w)) * d.channels;
  } else {
    const scalar_t* point = points + 3 * slot;
    c = locate_corners<acc_t>(static_cast<acc_t>(point[0]), static_cast<acc_t>(point[1]), static_cast<acc_t>(point[2]),
                              d);
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

}  // namespace

// ------------------------------------------------------------------------------ entry point

at::Tensor grid_interpolate_cuda(const at::Tensor& grid_in, const at::Tensor& points_in) {
  const char* op = "grid_interpolate";
  check_grid_inputs(grid_in, points_in, at::kCUDA, op);
  const c10::cuda::CUDAGuard guard(grid_in.device());
  const at::Tensor grid = grid_in.contiguous(), points = points_in.contiguous();
  const int64_t n = points.size(0), channels = grid.size(3);
  at::Tensor out = at::empty({n, channels}, grid.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grid.scalar_type(), "grid_interpolate_cuda", [&] {
    // Large grids: visit the points in axis-0 bucket order (grid_interpolate_buckets.cuh). Only where the
    // accumulation type is float, since the reordered points are stored as floats.
    constexpr bool kReorderable = std::is_same<at::opmath_type<scalar_t>, float>::value;
    const ReorderMode mode = reorder_mode(op);
    const int64_t slices =
        kReorderable
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
            kernel<<<block_count(32 * warps, kThreads, op), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                grid_ptr, points.data_ptr<scalar_t>(), bucketed.order, out_ptr, n, grid_shape(grid));
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          };
          if constexpr (kReorderable) {
            if (bucketed.order.sorted != nullptr)
              return run(grid_forward_kernel<scalar_t, VEC, kGroup, kOnePass, true>);
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

}  // namespace cuda_ext
