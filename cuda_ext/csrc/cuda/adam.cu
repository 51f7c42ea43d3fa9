// The row-sparse Adam family on CUDA (adam.h).
//
// sparse_adam_step. Bandwidth bound: per listed row it reads param, grad and both moments and writes
// param and the moments, 7 * C elements (8 with clear_grad: the row's gradient stored back as zeros), and nothing
// of the rows not listed, so the time follows K, not M.
//
// Layout: a row is handled by kLanes neighbouring lanes (the smallest power of two that covers its C channels in
// packs of kVec elements, at most a warp), so one warp-wide load covers 32 / kLanes whole rows, each a coalesced
// run; packs are 16, 8 or 4 bytes when C and the pointers allow (C = 12 float32: 3 float4 per row), else single
// elements (C = 13: 13 lanes of 16). A grid-stride loop over the rows, kUnroll rows per lane per pass whose loads
// are all issued before any math, keeps enough bytes in flight per thread to cover DRAM latency.
//
// masked_adam_step. Adam is elementwise, so rows do not matter: the four arrays are one flat run of packs (16
// bytes where the element count and the pointers allow, whatever C is: the C = 1 density grid too). A thread reads
// its packs of the gradient and reads and writes param and the moments only for the packs with a non-zero element,
// so the traffic is the whole gradient plus 6 elements per element of a touched pack. Those dependent loads wait
// for the gradient's; the next pass's gradient loads are issued before them, so the two round trips overlap.
// With clear_grad a touched pack's gradient is stored back as zeros (where a fresh zero gradient would cost a fill
// of the whole tensor before the next backward), and so are the other packs of its 32-byte sector: the lanes of a
// sector agree by shuffle, so every clear is a whole sector (HBM with ECC turns a partial one into a
// read-modify-write). A zero pack cleared again stays zero; nothing past the tensor is written.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "adam.h"
#include "kernel_common.h"
#include "ops.h"
#include "vector_memory.cuh"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename scalar_t>
struct AdamPointers {
  scalar_t* __restrict__ param;
  const scalar_t* grad;  // not __restrict__: with clear_grad the kernels write it through another pointer
  scalar_t* __restrict__ exp_avg;
  scalar_t* __restrict__ exp_avg_sq;
};

// Plain (coherent) vector access: param and the moments are read, then written, by the same thread.
template <typename scalar_t, int kVec>
__device__ __forceinline__ Vec<scalar_t, kVec> load_plain(const scalar_t* p) {
  return *reinterpret_cast<const Vec<scalar_t, kVec>*>(p);
}

template <typename scalar_t, int kVec>
__device__ __forceinline__ void store_plain(scalar_t* p, const Vec<scalar_t, kVec>& value) {
  *reinterpret_cast<Vec<scalar_t, kVec>*>(p) = value;
}

// True when any of the pack's gradient elements is non-zero (or NaN).
template <typename scalar_t, int kVec>
__device__ __forceinline__ bool any_nonzero(const Vec<scalar_t, kVec>& g) {
  bool any = false;
#pragma unroll
  for (int e = 0; e < kVec; ++e) any |= g.v[e] != scalar_t(0);
  return any;
}

// Whether any of the kGroup neighbouring lanes (aligned groups of a warp) has `value`; every lane of the warp calls it.
template <int kGroup>
__device__ __forceinline__ bool any_in_lane_group(bool value) {
#pragma unroll
  for (int s = 1; s < kGroup; s <<= 1) value |= __shfl_xor_sync(0xffffffffu, value, s) != 0;
  return value;
}

// rows: the K listed rows of the (M, C) arrays.
template <typename scalar_t, int kVec, int kLanes>
__global__ void __launch_bounds__(kThreads)
    sparse_adam_kernel(AdamPointers<scalar_t> ptr, const int64_t* __restrict__ rows, int64_t k_rows, int64_t m_rows,
                       int64_t channels, AdamCoefficients<scalar_t> k,
                       scalar_t* clear) {  // the gradient again (or null): its listed rows zeroed after the step
  constexpr int kSlotsPerBlock = kThreads / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t first = int64_t(blockIdx.x) * kSlotsPerBlock + threadIdx.x / kLanes;
  const int64_t stride = int64_t(gridDim.x) * kSlotsPerBlock;
  for (int64_t r0 = first; r0 < k_rows; r0 += stride * kUnroll) {
    int64_t base[kUnroll];  // the row's first element, or -1: no row (past K, or out of range)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t r = r0 + u * stride;
      const int64_t row = r >= k_rows ? -1 : __ldg(rows + r);
      base[u] = row >= 0 && row < m_rows ? row * channels : -1;
    }
    for (int64_t c = int64_t(lane) * kVec; c < channels; c += int64_t(kLanes) * kVec) {
      Vec<scalar_t, kVec> p[kUnroll], g[kUnroll], m[kUnroll], v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base[u] < 0) continue;
        const int64_t i = base[u] + c;
        // read-only path unless this kernel writes the gradient (then a coherent load)
        g[u] = clear != nullptr ? load_plain<scalar_t, kVec>(ptr.grad + i)
                                : load_vec<scalar_t, kVec, /*kStreaming=*/false>(ptr.grad + i);
        p[u] = load_plain<scalar_t, kVec>(ptr.param + i);
        m[u] = load_plain<scalar_t, kVec>(ptr.exp_avg + i);
        v[u] = load_plain<scalar_t, kVec>(ptr.exp_avg_sq + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base[u] < 0) continue;
#pragma unroll
        for (int e = 0; e < kVec; ++e) adam_element<scalar_t>(p[u].v[e], g[u].v[e], m[u].v[e], v[u].v[e], k);
        const int64_t i = base[u] + c;
        store_plain(ptr.param + i, p[u]);
        store_plain(ptr.exp_avg + i, m[u]);
        store_plain(ptr.exp_avg_sq + i, v[u]);
        if (clear != nullptr) store_plain(clear + i, Vec<scalar_t, kVec>{});
      }
    }
  }
}

// masked_adam_step over `packs` packs of kVec elements (module comment). Pass j of a thread covers packs
// first + (j kUnroll + u) stride, u < kUnroll: each of the kUnroll loads is one coalesced run across the warp.
template <typename scalar_t, int kVec>
__device__ __forceinline__ void load_gradient_packs(const scalar_t* __restrict__ grad, int64_t first, int64_t stride,
                                                    int64_t packs, Vec<scalar_t, kVec> (&g)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = first + u * stride;
    if (i < packs) g[u] = load_vec<scalar_t, kVec, /*kStreaming=*/true>(grad + i * kVec);
  }
}

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    masked_adam_kernel(AdamPointers<scalar_t> ptr, int64_t packs, AdamCoefficients<scalar_t> k,
                       scalar_t* clear) {  // the gradient again (or null), cleared by the lanes that read it
  constexpr int kPackBytes = int(sizeof(scalar_t)) * kVec;
  constexpr int kPacksPerSector = kPackBytes >= 32 ? 1 : 32 / kPackBytes;  // lane % group = pack % group:
  const int64_t stride = int64_t(gridDim.x) * kThreads, pass = stride * kUnroll;
  const int warp_lane = threadIdx.x % 32;  // kThreads and the stride are multiples of 32
  int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  Vec<scalar_t, kVec> g[kUnroll];
  load_gradient_packs(ptr.grad, first, stride, packs, g);
  for (; first - warp_lane < packs; first += pass) {  // warp-uniform: the whole warp takes part in the shuffles
    Vec<scalar_t, kVec> next[kUnroll];                // in flight while this pass waits for param and the moments
    load_gradient_packs(ptr.grad, first + pass, stride, packs, next);
    Vec<scalar_t, kVec> p[kUnroll], m[kUnroll], v[kUnroll];
    bool live[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = (first + u * stride) * kVec;
      live[u] = first + u * stride < packs && any_nonzero(g[u]);
      if (!live[u]) continue;
      p[u] = load_plain<scalar_t, kVec>(ptr.param + i);
      m[u] = load_plain<scalar_t, kVec>(ptr.exp_avg + i);
      v[u] = load_plain<scalar_t, kVec>(ptr.exp_avg_sq + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t pack = first + u * stride, i = pack * kVec;
      if (clear != nullptr && any_in_lane_group<kPacksPerSector>(live[u]) && pack < packs) {
        store_plain(clear + i, Vec<scalar_t, kVec>{});  // the gradient is in registers already
      }
      if (!live[u]) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e) masked_adam_element<scalar_t>(p[u].v[e], g[u].v[e], m[u].v[e], v[u].v[e], k);
      store_plain(ptr.param + i, p[u]);
      store_plain(ptr.exp_avg + i, m[u]);
      store_plain(ptr.exp_avg_sq + i, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) g[u] = next[u];
  }
}

// As many blocks as the work needs (`items` over `per_block_pass` a block pass), at most as many as fit at once.
template <typename Kernel>
unsigned int grid_stride_blocks(Kernel kernel, int64_t items, int64_t per_block_pass) {
  const int64_t wanted = (items + per_block_pass - 1) / per_block_pass;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(wanted, resident_blocks(kernel, kThreads))));
}

template <typename scalar_t, int kVec, int kLanes>
void launch(const AdamPointers<scalar_t>& ptr, const int64_t* rows, int64_t k_rows, int64_t m_rows, int64_t channels,
            const AdamCoefficients<scalar_t>& k, scalar_t* clear) {
  auto kernel = sparse_adam_kernel<scalar_t, kVec, kLanes>;
  const unsigned int blocks = grid_stride_blocks(kernel, k_rows, int64_t(kThreads / kLanes) * kUnroll);
  kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(ptr, rows, k_rows, m_rows, channels, k, clear);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// kLanes: the smallest power of two >= the packs of a row, at most a warp.
template <typename scalar_t, int kVec>
void launch_for_width(const AdamPointers<scalar_t>& ptr, const int64_t* rows, int64_t k_rows, int64_t m_rows,
                      int64_t channels, const AdamCoefficients<scalar_t>& k, scalar_t* clear) {
  const int64_t packs = channels / kVec;
  if (packs <= 1) return launch<scalar_t, kVec, 1>(ptr, rows, k_rows, m_rows, channels, k, clear);
  if (packs <= 2) return launch<scalar_t, kVec, 2>(ptr, rows, k_rows, m_rows, channels, k, clear);
  if (packs <= 4) return launch<scalar_t, kVec, 4>(ptr, rows, k_rows, m_rows, channels, k, clear);
  if (packs <= 8) return launch<scalar_t, kVec, 8>(ptr, rows, k_rows, m_rows, channels, k, clear);
  if (packs <= 16) return launch<scalar_t, kVec, 16>(ptr, rows, k_rows, m_rows, channels, k, clear);
  return launch<scalar_t, kVec, 32>(ptr, rows, k_rows, m_rows, channels, k, clear);
}

// The widest pack (16, 8 or 4 bytes... down to one element) that divides C and every pointer's alignment.
template <typename scalar_t>
bool packs_fit(const AdamPointers<scalar_t>& ptr, int64_t channels, int vec) {
  const int64_t bytes = int64_t(vec) * sizeof(scalar_t);
  return channels % vec == 0 && aligned_to(ptr.param, bytes) && aligned_to(ptr.grad, bytes) &&
         aligned_to(ptr.exp_avg, bytes) && aligned_to(ptr.exp_avg_sq, bytes);
}

// The widest pack (16, 8 or 4 bytes, else one element) that `channels` and the pointers allow: fn(vec), a
// std::integral_constant (masked_adam_step passes the element count as `channels`: its arrays are flat).
template <typename scalar_t, typename Fn>
void with_widest_pack(const AdamPointers<scalar_t>& ptr, int64_t channels, Fn&& fn) {
  constexpr int kWide = 16 / sizeof(scalar_t);  // 4 floats or 2 doubles
  constexpr int kHalf = kWide >= 4 ? 2 : 1;
  if (packs_fit(ptr, channels, kWide)) return fn(std::integral_constant<int, kWide>{});
  if (kHalf > 1 && packs_fit(ptr, channels, kHalf)) return fn(std::integral_constant<int, kHalf>{});
  fn(std::integral_constant<int, 1>{});
}

template <typename scalar_t>
AdamPointers<scalar_t> adam_pointers(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                     const at::Tensor& exp_avg_sq) {
  return {param.data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(), exp_avg.data_ptr<scalar_t>(),
          exp_avg_sq.data_ptr<scalar_t>()};
}

}  // namespace

void sparse_adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq, const at::Tensor& rows_in, int64_t step, double lr,
                           double beta1, double beta2, double eps, bool clear_grad) {
  check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows_in, step, lr, beta1, beta2, eps, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(param.device());
  const at::Tensor rows = rows_in.contiguous();
  const int64_t m_rows = param.size(0), channels = param.size(1), k_rows = rows.size(0);
  if (k_rows == 0 || channels == 0) return;
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "sparse_adam_step_cuda", [&] {
    const auto k = AdamCoefficients<scalar_t>::make(step, lr, beta1, beta2, eps);
    const auto ptr = adam_pointers<scalar_t>(param, grad, exp_avg, exp_avg_sq);
    scalar_t* clear = clear_grad ? grad.data_ptr<scalar_t>() : nullptr;
    with_widest_pack(ptr, channels, [&](auto vec) {
      launch_for_width<scalar_t, decltype(vec)::value>(ptr, rows.const_data_ptr<int64_t>(), k_rows, m_rows, channels, k,
                                                       clear);
    });
  });
}

void masked_adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                           double eps, bool clear_grad) {
  check_masked_adam_inputs(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(param.device());
  const int64_t elements = param.numel();
  if (elements == 0) return;
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "masked_adam_step_cuda", [&] {
    const auto k = AdamCoefficients<scalar_t>::make(step, lr, beta1, beta2, eps);
    const auto ptr = adam_pointers<scalar_t>(param, grad, exp_avg, exp_avg_sq);
    with_widest_pack(ptr, elements, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      auto kernel = masked_adam_kernel<scalar_t, kVec>;
      const int64_t packs = elements / kVec;
      const unsigned int blocks = grid_stride_blocks(kernel, packs, int64_t(kThreads) * kUnroll);
      scalar_t* clear = clear_grad ? grad.data_ptr<scalar_t>() : nullptr;
      kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(ptr, packs, k, clear);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace cuda_ext
