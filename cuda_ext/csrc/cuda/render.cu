// volume_render on CUDA: one warp per ray, 32 samples at a time (render.h has the formulas).
//
// Why a warp and not a thread per ray: a ray's samples are contiguous, so 32 lanes on 32 consecutive samples read
// consecutive memory, where 32 threads on 32 rays would each stream a different place. The transmittance is a
// prefix sum along the ray: a warp scan per chunk of 32 samples plus the carry of the chunks before; early
// termination stops a ray's loop at the first chunk whose carried transmittance is below early_stop.
//
// Why the backward's value rows go through shared memory: lane l owns sample base + l, whose row of C values lies C
// words after its neighbour's. Read row-wise from global memory, each load instruction of the warp touches up to 32
// sectors and the next C - 1 instructions touch them again; the backward's value-gradient stores do the same and
// are not merged by L1 (this held the backward at 25% of copy bandwidth with C = 12). So the warp copies the
// chunk's count * C values as one flat range (lane l moves words l, l + 32, ...: each instruction one or two
// 128-byte lines, all loads in flight before the first store) into a per-warp tile whose rows are padded to an odd
// stride (each lane then reads its own row without bank conflicts), and writes the value gradients back the same
// way. The tile holds 32 rows of up to kMaxC + 1 words (C is bounded by a template: 4, 16 or 64).
//
// Every sample is written by the backward (zeros after an early stop, and for samples in no ray: those after the
// last ray by a grid-wide pass from the last offset, read on the device), so its outputs need no memset. (The
// forward reads rows in place: see render_forward_kernel.)
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernel_common.h"
#include "ops.h"
#include "padding.cuh"
#include "render.h"
#include "warp_scan.cuh"

namespace cuda_ext {
namespace {

constexpr int kForwardThreads = 256;  // 8 rays per block

template <int kMaxC>
struct TileShape {
  static constexpr int kWarps = kMaxC <= 16 ? 8 : 2;  // rays per block: keeps the 64-channel tiles under 48 KB
  static constexpr int kThreads = kWarps * kWarp;
  static constexpr int kWords = kWarp * (kMaxC + 1);  // one warp's tile: 32 rows, odd stride <= kMaxC + 1
};

// Where word k = lane + 32 j of a chunk's flat value range sits in the tile: row k / C, column k % C, advanced
// from j to j + 1 without a division (32 = q C + r).
struct FlatLayout {
  int channels, stride, row0, col0, q, r;
  __device__ FlatLayout(int c, int lane)
      : channels(c),
        stride(c | 1),
        row0(lane / max(c, 1)),
        col0(lane % max(c, 1)),
        q(kWarp / max(c, 1)),
        r(kWarp % max(c, 1)) {}  // C = 0: no words to move
};

// tile rows [0, count) <- src[0, count * C): one flat, coalesced pass; all loads issued before the stores.
template <int kMaxC, typename scalar_t>
__device__ __forceinline__ void load_tile(const scalar_t* __restrict__ src, int count, const FlatLayout& f, int lane,
                                          scalar_t* tile) {
  const int total = count * f.channels;
  scalar_t word[kMaxC];
#pragma unroll
  for (int j = 0; j < kMaxC; ++j) word[j] = lane + j * kWarp < total ? src[lane + j * kWarp] : scalar_t(0);
  int row = f.row0, col = f.col0;
#pragma unroll
  for (int j = 0; j < kMaxC; ++j) {
    if (lane + j * kWarp < total) tile[row * f.stride + col] = word[j];
    row += f.q;
    col += f.r;
    if (col >= f.channels) col -= f.channels, ++row;
  }
}

// dst[0, count * C) <- tile rows [0, count), the same way round.
template <int kMaxC, typename scalar_t>
__device__ __forceinline__ void store_tile(const scalar_t* tile, int count, const FlatLayout& f, int lane,
                                           scalar_t* __restrict__ dst) {
  const int total = count * f.channels;
  int row = f.row0, col = f.col0;
#pragma unroll
  for (int j = 0; j < kMaxC; ++j) {
    if (lane + j * kWarp < total) dst[lane + j * kWarp] = tile[row * f.stride + col];
    row += f.q;
    col += f.r;
    if (col >= f.channels) col -= f.channels, ++row;
  }
}

// The forward reads value rows in place: its loads go through L1, which holds the chunk's few lines while the
// lanes read their rows, so a tile would only add work (measured: C = 12 forward 0.229 ms tiled, 0.172 ms not,
// 131072 rays). Each lane loads its sample's optical depth, distance and values together, before the scan, so
// the three loads are in flight at once.
template <typename scalar_t, int kMaxC>
__global__ void __launch_bounds__(kForwardThreads)
    render_forward_kernel(const scalar_t* __restrict__ sd, const scalar_t* __restrict__ v,
                          const scalar_t* __restrict__ t, const int64_t* __restrict__ offsets, int64_t rays, int64_t n,
                          int channels, scalar_t early_stop, scalar_t* __restrict__ out, scalar_t* __restrict__ opacity,
                          scalar_t* __restrict__ depth) {
  const int lane = threadIdx.x % kWarp;
  const int64_t b = int64_t(blockIdx.x) * (kForwardThreads / kWarp) + threadIdx.x / kWarp;
  if (b >= rays) return;  // whole warps leave together
  const RayRange range = ray_range(offsets, b, n);
  scalar_t acc[kMaxC];
#pragma unroll
  for (int c = 0; c < kMaxC; ++c) acc[c] = 0;
  scalar_t carry = 0, op = 0, dp = 0;  // carry: optical depth of the chunks before
  for (int64_t base = range.first; base < range.last; base += kWarp) {
    const int64_t i = base + lane;
    const bool valid = i < range.last;
    const scalar_t s = valid ? sd[i] : scalar_t(0), ti = valid ? t[i] : scalar_t(0);
    const scalar_t* src = v + i * channels;
    scalar_t row[kMaxC];
#pragma unroll
    for (int c = 0; c < kMaxC; ++c) row[c] = valid && c < channels ? src[c] : scalar_t(0);
    const scalar_t inclusive = warp_inclusive_scan(s, lane);
    const scalar_t transmittance = exp_of(-(carry + warp_exclusive_from(inclusive, lane)));
    if (valid && transmittance >= early_stop) {
      const scalar_t w = -transmittance * expm1_of(-s);
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) acc[c] += w * row[c];
      op += w;
      dp += w * ti;
    }
    carry += __shfl_sync(kAll, inclusive, kWarp - 1);
    if (exp_of(-carry) < early_stop) break;  // every later sample is below too (carry is warp-uniform)
  }
  op = warp_sum(op);
  dp = warp_sum(dp);
#pragma unroll
  for (int c = 0; c < kMaxC; ++c) {
    if (c < channels) {
      const scalar_t total = warp_sum(acc[c]);
      if (lane == 0) out[b * channels + c] = total;
    }
  }
  if (lane == 0) {
    opacity[b] = op;
    depth[b] = dp;
  }
}

// Zero gradients for samples [first, last), written flat by the warp.
template <typename scalar_t>
__device__ __forceinline__ void zero_samples(int64_t first, int64_t last, int channels, int lane,
                                             scalar_t* __restrict__ g_sd, scalar_t* __restrict__ g_v) {
  for (int64_t i = first + lane; i < last; i += kWarp) g_sd[i] = 0;
  for (int64_t k = first * channels + lane; k < last * channels; k += kWarp) g_v[k] = 0;
}

template <typename scalar_t, int kMaxC>
__global__ void __launch_bounds__(TileShape<kMaxC>::kThreads)
    render_backward_kernel(const scalar_t* __restrict__ sd, const scalar_t* __restrict__ v,
                           const scalar_t* __restrict__ t, const int64_t* __restrict__ offsets, int64_t rays, int64_t n,
                           int channels, scalar_t early_stop, const scalar_t* __restrict__ out,
                           const scalar_t* __restrict__ opacity, const scalar_t* __restrict__ depth,
                           const scalar_t* __restrict__ g_out, const scalar_t* __restrict__ g_op,
                           const scalar_t* __restrict__ g_dp, scalar_t* __restrict__ g_sd, scalar_t* __restrict__ g_v) {
  __shared__ scalar_t tiles[TileShape<kMaxC>::kWarps][TileShape<kMaxC>::kWords];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t b = int64_t(blockIdx.x) * TileShape<kMaxC>::kWarps + warp;
  if (b >= rays) return;
  scalar_t* tile = tiles[warp];
  const FlatLayout layout(channels, lane);
  const RayRange range = ray_range(offsets, b, n);
  const scalar_t grad_op = g_op[b], grad_dp = g_dp[b];
  scalar_t go[kMaxC];
  scalar_t total = grad_op * opacity[b] + grad_dp * depth[b];  // G_b = sum_i w_i g_i, from the outputs
#pragma unroll
  for (int c = 0; c < kMaxC; ++c) {
    go[c] = c < channels ? g_out[b * channels + c] : scalar_t(0);
    if (c < channels) total += go[c] * out[b * channels + c];
  }
  scalar_t carry = 0, prefix_carry = 0;  // optical depth and sum w g of the chunks before
  int64_t base = range.first;
  for (; base < range.last; base += kWarp) {
    const int count = static_cast<int>(min(int64_t(kWarp), range.last - base));
    const bool valid = lane < count;
    const scalar_t s = valid ? sd[base + lane] : scalar_t(0), ti = valid ? t[base + lane] : scalar_t(0);
    load_tile<kMaxC>(v + base * channels, count, layout, lane, tile);
    const scalar_t inclusive = warp_inclusive_scan(s, lane);
    const scalar_t transmittance = exp_of(-(carry + warp_exclusive_from(inclusive, lane)));
    const bool alive = valid && transmittance >= early_stop;
    // w as the forward computes it (expm1: T_i - T_{i+1} would cancel for small s), T_{i+1} = T_i - w_i
    const scalar_t w = alive ? -transmittance * expm1_of(-s) : scalar_t(0);
    const scalar_t after = transmittance - w;
    __syncwarp();  // the tile is complete
    scalar_t g = 0;
    if (valid) {  // the lane's own row: read v_i, then overwrite it with d/dv_i (zero past an early stop)
      scalar_t* row = tile + lane * layout.stride;
      g = grad_op + grad_dp * ti;
#pragma unroll
      for (int c = 0; c < kMaxC; ++c) {
        if (c < channels) {
          g += go[c] * row[c];
          row[c] = alive ? w * go[c] : scalar_t(0);
        }
      }
    }
    __syncwarp();  // every row holds its gradient
    store_tile<kMaxC>(tile, count, layout, lane, g_v + base * channels);
    const scalar_t prefix = prefix_carry + warp_inclusive_scan(alive ? w * g : scalar_t(0), lane);
    if (valid) g_sd[base + lane] = alive ? after * g - (total - prefix) : scalar_t(0);
    carry += __shfl_sync(kAll, inclusive, kWarp - 1);
    prefix_carry = __shfl_sync(kAll, prefix, kWarp - 1);
    __syncwarp();  // the tile is read out before the next chunk overwrites it
    if (exp_of(-carry) < early_stop) {
      base += kWarp;
      break;
    }
  }
  // the samples after an early stop contribute nothing: zero gradients, written flat
  zero_samples(base, range.last, channels, lane, g_sd, g_v);
  // samples before the first ray (offsets not starting at 0: invalid, not checked on CUDA) get zero gradients too,
  // as from the CPU kernel; consecutive ranges leave no gaps. The rows after the last ray (a padded pack's padding,
  // possibly a quarter of N) are zeroed by the whole grid afterwards (zero_rows_from), not by this one warp.
  if (b == 0) zero_samples(0, min(range.first, n), channels, lane, g_sd, g_v);
}

// Calls fn(std::integral_constant<int, kMaxC>) with the smallest channel bound that holds `channels`.
template <typename Fn>
void dispatch_channels(int64_t channels, Fn&& fn) {
  if (channels <= 4) {
    fn(std::integral_constant<int, 4>{});
  } else if (channels <= 16) {
    fn(std::integral_constant<int, 16>{});
  } else {
    fn(std::integral_constant<int, 64>{});
  }
}

void check_channels(int64_t channels, const char* op) {
  TORCH_CHECK(channels <= 64, op, ": values may have at most 64 channels on CUDA, got ", channels);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> volume_render_cuda(const at::Tensor& optical_depth_in,
                                                                  const at::Tensor& values_in, const at::Tensor& t_in,
                                                                  const at::Tensor& ray_offsets_in, double early_stop) {
  check_render_inputs(optical_depth_in, values_in, t_in, ray_offsets_in, early_stop, at::kCUDA, "volume_render");
  check_channels(values_in.size(1), "volume_render");
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), v = values_in.contiguous(), t = t_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous();
  const int64_t rays = offsets.size(0) - 1, channels = v.size(1);
  at::Tensor out = at::empty({rays, channels}, v.options());
  at::Tensor opacity = at::empty({rays}, v.options()), depth = at::empty({rays}, v.options());
  if (rays == 0) return {out, opacity, depth};
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "volume_render_cuda", [&] {
    dispatch_channels(channels, [&](auto bound) {
      const unsigned int blocks = block_count(rays * kWarp, kForwardThreads, "volume_render");
      render_forward_kernel<scalar_t, decltype(bound)::value>
          <<<blocks, kForwardThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              sd.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), t.const_data_ptr<scalar_t>(),
              offsets.const_data_ptr<int64_t>(), rays, sd.size(0), static_cast<int>(channels),
              static_cast<scalar_t>(early_stop), out.data_ptr<scalar_t>(), opacity.data_ptr<scalar_t>(),
              depth.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {out, opacity, depth};
}

std::tuple<at::Tensor, at::Tensor> volume_render_backward_cuda(
    const at::Tensor& grad_values_in, const at::Tensor& grad_opacity_in, const at::Tensor& grad_depth_in,
    const at::Tensor& optical_depth_in, const at::Tensor& values_in, const at::Tensor& t_in,
    const at::Tensor& ray_offsets_in, const at::Tensor& out_in, const at::Tensor& opacity_in,
    const at::Tensor& depth_in, double early_stop) {
  const char* op = "volume_render_backward";
  check_render_inputs(optical_depth_in, values_in, t_in, ray_offsets_in, early_stop, at::kCUDA, op);
  check_channels(values_in.size(1), op);
  const int64_t rays = ray_offsets_in.size(0) - 1;
  check_render_grads(grad_values_in, grad_opacity_in, grad_depth_in, values_in, rays, op);
  check_render_grads(out_in, opacity_in, depth_in, values_in, rays, op);
  const c10::cuda::CUDAGuard device_guard(optical_depth_in.device());
  const at::Tensor sd = optical_depth_in.contiguous(), v = values_in.contiguous(), t = t_in.contiguous();
  const at::Tensor offsets = ray_offsets_in.contiguous(), out = out_in.contiguous();
  const at::Tensor opacity = opacity_in.contiguous(), depth = depth_in.contiguous();
  const at::Tensor g_out = grad_values_in.contiguous(), g_op = grad_opacity_in.contiguous();
  const at::Tensor g_dp = grad_depth_in.contiguous();
  if (rays == 0) return {at::zeros_like(sd), at::zeros_like(v)};
  // every sample before the last offset is written (render_backward_kernel), so no memset (another pass over
  // N * (C + 1) words): only the rows past it (padding) are zeroed, from the offset on the device
  at::Tensor g_sd = at::empty_like(sd), g_v = at::empty_like(v);
  const int64_t channels = v.size(1);
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "volume_render_backward_cuda", [&] {
    dispatch_channels(channels, [&](auto bound) {
      using Shape = TileShape<decltype(bound)::value>;
      const unsigned int blocks = block_count(rays * kWarp, Shape::kThreads, op);
      render_backward_kernel<scalar_t, decltype(bound)::value>
          <<<blocks, Shape::kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              sd.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(), t.const_data_ptr<scalar_t>(),
              offsets.const_data_ptr<int64_t>(), rays, sd.size(0), static_cast<int>(channels),
              static_cast<scalar_t>(early_stop), out.const_data_ptr<scalar_t>(), opacity.const_data_ptr<scalar_t>(),
              depth.const_data_ptr<scalar_t>(), g_out.const_data_ptr<scalar_t>(), g_op.const_data_ptr<scalar_t>(),
              g_dp.const_data_ptr<scalar_t>(), g_sd.data_ptr<scalar_t>(), g_v.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    zero_rows_from<scalar_t>(g_sd, offsets.const_data_ptr<int64_t>() + rays);
    zero_rows_from<scalar_t>(g_v, offsets.const_data_ptr<int64_t>() + rays);
  });
  return {g_sd, g_v};
}

}  // namespace cuda_ext
