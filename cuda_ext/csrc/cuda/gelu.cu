// GELU on CUDA. Bandwidth bound, so the kernels only move memory well: 16-byte packs per load and
// store, several packs in flight per thread, then a scalar tail.
// Half and bfloat16 compute in float (at::opmath_type); the math is shared with the CPU (gelu.h).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <limits>

#include "gelu.h"
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

}  // namespace

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
