// GELU on CUDA. Bandwidth bound, so the kernels only move memory well: 16-byte packs per load and
// store, several packs in flight per thread, then a scalar tail.
// Half and bfloat16 compute in float (at::opmath_type); the math is shared with the CPU (gelu.h).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <tuple>

#include "gelu.h"
#include "kernel_common.h"
#include "ops.h"
#include "vector_memory.cuh"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kPackBytes = 16;

// y = gelu(x).
template <typename scalar_t, bool kTanh>
struct GeluForwardOp {
  static constexpr int kInputs = 1;
  const scalar_t* __restrict__ in[kInputs];  // x
  scalar_t* __restrict__ out;                // y

  __device__ __forceinline__ scalar_t operator()(const scalar_t (&v)[kInputs]) const {
    return static_cast<scalar_t>(GeluMath<at::opmath_type<scalar_t>, kTanh>::value(v[0]));
  }
};

// grad_x = grad_out * gelu'(x).
template <typename scalar_t, bool kTanh>
struct GeluBackwardOp {
  static constexpr int kInputs = 2;
  const scalar_t* __restrict__ in[kInputs];  // grad_out, x
  scalar_t* __restrict__ out;                // grad_x

  __device__ __forceinline__ scalar_t operator()(const scalar_t (&v)[kInputs]) const {
    using acc_t = at::opmath_type<scalar_t>;
    return static_cast<scalar_t>(static_cast<acc_t>(v[0]) * GeluMath<acc_t, kTanh>::derivative(v[1]));
  }
};

// Packs per thread: all of a thread's loads are issued before any math, so each thread keeps
// kUnroll * kInputs 16-byte loads in flight (one per thread is too few to cover DRAM latency).
constexpr int kUnroll = 4;

// Every element of [0, n) exactly once. Block b owns packs [b * kThreads * kUnroll, ...), its
// threads kThreads apart so each load instruction is coalesced; the n % kVec leftovers go to the
// first threads of the grid, one element each.
template <int kVec, typename Op, typename scalar_t>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(int64_t n, Op op) {
  constexpr int kInputs = Op::kInputs;
  const int64_t packs = n / kVec;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
  Vec<scalar_t, kVec> in[kUnroll][kInputs];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t p = first + u * kThreads;
    if (p < packs) {
#pragma unroll
      // Read-only path, not evict-first: F.gelu's time with __ldg (H100), 1-2% slower with __ldcs.
      for (int a = 0; a < kInputs; ++a) in[u][a] = load_vec<scalar_t, kVec, /*kStreaming=*/false>(op.in[a] + p * kVec);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t p = first + u * kThreads;
    if (p < packs) {
      Vec<scalar_t, kVec> result;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        scalar_t v[kInputs];
#pragma unroll
        for (int a = 0; a < kInputs; ++a) v[a] = in[u][a].v[j];
        result.v[j] = op(v);
      }
      store_vec(op.out + p * kVec, result);
    }
  }
  const int64_t tail = packs * kVec + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (tail < n) {
    scalar_t v[kInputs];
#pragma unroll
    for (int a = 0; a < kInputs; ++a) v[a] = op.in[a][tail];
    op.out[tail] = op(v);
  }
}

// Launches op over n elements, with 16-byte packs when every pointer allows them.
template <typename scalar_t, typename Op>
void launch_elementwise(int64_t n, const Op& op) {
  if (n == 0) return;
  bool aligned = aligned_to(op.out, kPackBytes);
  for (const scalar_t* p : op.in) aligned = aligned && aligned_to(p, kPackBytes);
  auto launch = [&](auto kernel, int64_t vec) {
    const int64_t per_block = int64_t(kThreads) * kUnroll * vec;
    const int64_t blocks = std::max<int64_t>((n + per_block - 1) / per_block, 1);
    TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), "gelu: too many elements for one launch (", n, ")");
    kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(n, op);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  constexpr int kVec = kPackBytes / sizeof(scalar_t);
  if (aligned) {
    launch(elementwise_kernel<kVec, Op, scalar_t>, kVec);
  } else {
    launch(elementwise_kernel<1, Op, scalar_t>, 1);
  }
}

// The rows ops: element (i, j) of the pre-activation is x[i, j] + rows[index[i], j], the sum rounded to scalar_t
// first (as x + rows[index] is in the reference). An index outside [0, count) (not checked on the host: that would
// cost a sync) turns its row into NaN rather than reading out of bounds.
template <typename scalar_t, int kVec>
__device__ __forceinline__ at::opmath_type<scalar_t> pre_activation(const Vec<scalar_t, kVec>& xs,
                                                                    const Vec<scalar_t, kVec>& bias, int e) {
  return static_cast<at::opmath_type<scalar_t>>(static_cast<scalar_t>(xs.v[e] + bias.v[e]));
}

template <typename scalar_t, int kVec>
__device__ __forceinline__ Vec<scalar_t, kVec> nan_pack() {
  Vec<scalar_t, kVec> result;
#pragma unroll
  for (int e = 0; e < kVec; ++e) result.v[e] = static_cast<scalar_t>(NAN);
  return result;
}

// Forward: one thread per pack of kVec along a row (16 bytes: 8 bf16 or 4 float), so x and out move as in the
// elementwise kernel and rows' packs, a few hundred rows reused by every sample of a ray, come from L2.
template <int kVec, bool kTanh, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    gelu_rows_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ rows,
                     const int64_t* __restrict__ index, scalar_t* __restrict__ out, int64_t packs,
                     int64_t packs_per_row, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < packs; p += stride) {
    const int64_t i = p / packs_per_row, j = p - i * packs_per_row;
    const int64_t row = index[i];
    Vec<scalar_t, kVec> result = nan_pack<scalar_t, kVec>();
    if (row >= 0 && row < count) {
      const Vec<scalar_t, kVec> xs = load_vec<scalar_t, kVec, /*kStreaming=*/false>(x + p * kVec);
      const Vec<scalar_t, kVec> bias =
          load_vec<scalar_t, kVec, /*kStreaming=*/false>(rows + (row * packs_per_row + j) * kVec);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        result.v[e] =
            static_cast<scalar_t>(GeluMath<at::opmath_type<scalar_t>, kTanh>::value(pre_activation(xs, bias, e)));
      }
    }
    store_vec(out + p * kVec, result);
  }
}

// Backward: grad_x = grad_out * gelu'(pre) and grad_rows[r] = the sum of grad_x over the samples with index r, in
// one pass (no (N, H) float32 copy of grad_x and no index_add). Thread (run, pack j) walks kRun consecutive samples
// down one pack column: it writes grad_x and sums it (as rounded to scalar_t, in acc_t) in registers while the
// index stays the same, and adds the sum into grad_rows when the index changes and at the run's end (atomics:
// another run may hold samples of the same row). The decoder's samples come grouped by ray, so a run adds about
// once per ray it touches; any order is summed correctly. The P threads of a run read one sample's row of P packs
// at a time: coalesced.
constexpr int kRun = 32;

template <int kVec, bool kTanh, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    gelu_rows_backward_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ x,
                              const scalar_t* __restrict__ rows, const int64_t* __restrict__ index,
                              scalar_t* __restrict__ grad_x, at::opmath_type<scalar_t>* __restrict__ grad_rows,
                              int64_t n, int64_t packs_per_row, int64_t count) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t threads = (n + kRun - 1) / kRun * packs_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < threads; t += stride) {
    const int64_t run = t / packs_per_row, j = t - run * packs_per_row;
    const int64_t end = std::min(n, (run + 1) * kRun);
    acc_t sum[kVec];
    int64_t current = -1;  // the row being summed (-1: none yet)
    for (int64_t i = run * kRun; i < end; ++i) {
      const int64_t row = index[i], p = i * packs_per_row + j;
      if (row != current) {
        if (current >= 0) atomic_add_vec(grad_rows + (current * packs_per_row + j) * kVec, sum);
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum[e] = acc_t(0);
        current = row >= 0 && row < count ? row : -1;
      }
      if (current < 0) {
        store_vec(grad_x + p * kVec, nan_pack<scalar_t, kVec>());
        continue;
      }
      const Vec<scalar_t, kVec> xs = load_vec<scalar_t, kVec, /*kStreaming=*/false>(x + p * kVec);
      const Vec<scalar_t, kVec> grads = load_vec<scalar_t, kVec, /*kStreaming=*/false>(grad_out + p * kVec);
      const Vec<scalar_t, kVec> bias =
          load_vec<scalar_t, kVec, /*kStreaming=*/false>(rows + (row * packs_per_row + j) * kVec);
      Vec<scalar_t, kVec> result;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        result.v[e] = static_cast<scalar_t>(static_cast<acc_t>(grads.v[e]) *
                                            GeluMath<acc_t, kTanh>::derivative(pre_activation(xs, bias, e)));
        sum[e] += static_cast<acc_t>(result.v[e]);
      }
      store_vec(grad_x + p * kVec, result);
    }
    if (current >= 0) atomic_add_vec(grad_rows + (current * packs_per_row + j) * kVec, sum);
  }
}

// Packs of 16 bytes where the width and every pointer allow, else single elements: fn(integral_constant vec).
template <typename scalar_t, typename Fn>
void with_rows_pack(int64_t width, std::initializer_list<const void*> pointers, Fn&& fn) {
  constexpr int kWide = kPackBytes / sizeof(scalar_t);
  bool wide = width % kWide == 0;
  for (const void* p : pointers) wide = wide && aligned_to(p, kPackBytes);
  with_vector_width<kWide>(wide, fn);
}

unsigned int rows_blocks(int64_t threads) {
  return static_cast<unsigned int>(
      std::max<int64_t>(1, std::min<int64_t>((threads + kThreads - 1) / kThreads, int64_t(1) << 20)));
}

}  // namespace

at::Tensor gelu_rows_cuda(const at::Tensor& x_in, const at::Tensor& rows_in, const at::Tensor& index_in,
                          c10::string_view approximate) {
  const GeluRowsArgs args = prepare_gelu_rows(nullptr, x_in, rows_in, index_in, approximate, at::kCUDA, "gelu_rows");
  const at::Tensor &x = args.x, &rows = args.rows, &index = args.index;
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(0), width = x.size(1), count = rows.size(0);
  if (n == 0 || width == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gelu_rows_cuda", [&] {
    const scalar_t* xs = x.const_data_ptr<scalar_t>();
    const scalar_t* rs = rows.const_data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    dispatch_gelu_approximate(args.mode, [&](auto tanh_tag) {
      with_rows_pack<scalar_t>(width, {xs, rs, dst}, [&](auto vec) {
        constexpr int kVec = decltype(vec)::value;
        const int64_t packs = n * width / kVec;
        gelu_rows_kernel<kVec, decltype(tanh_tag)::value, scalar_t>
            <<<rows_blocks(packs), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                xs, rs, index.const_data_ptr<int64_t>(), dst, packs, width / kVec, count);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> gelu_rows_backward_cuda(const at::Tensor& grad_out_in, const at::Tensor& x_in,
                                                           const at::Tensor& rows_in, const at::Tensor& index_in,
                                                           c10::string_view approximate) {
  const GeluRowsArgs args =
      prepare_gelu_rows(&grad_out_in, x_in, rows_in, index_in, approximate, at::kCUDA, "gelu_rows_backward");
  const at::Tensor &x = args.x, &rows = args.rows, &index = args.index, &grad_out = args.grad_out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  at::Tensor grad_rows = at::zeros(rows.sizes(), rows.options().dtype(at::toOpMathType(rows.scalar_type())));
  const int64_t n = x.size(0), width = x.size(1), count = rows.size(0);
  if (n == 0 || width == 0) return {grad_x, grad_rows};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gelu_rows_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* xs = x.const_data_ptr<scalar_t>();
    const scalar_t* rs = rows.const_data_ptr<scalar_t>();
    scalar_t* gx = grad_x.data_ptr<scalar_t>();
    acc_t* sums = grad_rows.data_ptr<acc_t>();  // 16-byte aligned (a fresh allocation), kVec acc_t apart per pack
    dispatch_gelu_approximate(args.mode, [&](auto tanh_tag) {
      with_rows_pack<scalar_t>(width, {g, xs, rs, gx}, [&](auto vec) {
        constexpr int kVec = decltype(vec)::value;
        const int64_t threads = (n + kRun - 1) / kRun * (width / kVec);
        gelu_rows_backward_kernel<kVec, decltype(tanh_tag)::value, scalar_t>
            <<<rows_blocks(threads), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
                g, xs, rs, index.const_data_ptr<int64_t>(), gx, sums, n, width / kVec, count);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {grad_x, grad_rows};
}

at::Tensor gelu_cuda(const at::Tensor& x_in, c10::string_view approximate) {
  const GeluApproximate mode = parse_gelu_approximate(approximate);
  check_gelu_input(x_in, "gelu");
  const at::Tensor x = contiguous_on(x_in, "x", at::kCUDA, "gelu");
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gelu_cuda", [&] {
    dispatch_gelu_approximate(mode, [&](auto tanh_tag) {
      const GeluForwardOp<scalar_t, decltype(tanh_tag)::value> op{{x.const_data_ptr<scalar_t>()},
                                                                  y.data_ptr<scalar_t>()};
      launch_elementwise<scalar_t>(x.numel(), op);
    });
  });
  return y;
}

at::Tensor gelu_backward_cuda(const at::Tensor& grad_out_in, const at::Tensor& x_in, c10::string_view approximate) {
  const GeluApproximate mode = parse_gelu_approximate(approximate);
  check_gelu_backward_inputs(grad_out_in, x_in);
  const at::Tensor x = contiguous_on(x_in, "x", at::kCUDA, "gelu_backward");
  const at::Tensor grad_out = contiguous_on(grad_out_in, "grad_out", at::kCUDA, "gelu_backward");
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gelu_backward_cuda", [&] {
    dispatch_gelu_approximate(mode, [&](auto tanh_tag) {
      const GeluBackwardOp<scalar_t, decltype(tanh_tag)::value> op{
          {grad_out.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>()}, grad_x.data_ptr<scalar_t>()};
      launch_elementwise<scalar_t>(x.numel(), op);
    });
  });
  return grad_x;
}

}  // namespace cuda_ext
