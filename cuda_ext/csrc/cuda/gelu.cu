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

// The rows ops: element (i, j) of the pre-activation is x[i, j] + rows[index[i], j]. One thread per pack of
// kVec along a row (16 bytes: 8 bf16 or 4 float), so x, grad_out and out move as in the elementwise kernel and
// rows' packs, a few hundred rows reused by every sample of a ray, come from L2. An index outside [0, count)
// (not checked on the host: that would cost a sync) turns its row into NaN rather than reading out of bounds.
template <int kVec, bool kBackward, bool kTanh, typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    gelu_rows_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ x,
                     const scalar_t* __restrict__ rows, const int64_t* __restrict__ index, scalar_t* __restrict__ out,
                     int64_t packs, int64_t packs_per_row, int64_t count) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < packs; p += stride) {
    const int64_t i = p / packs_per_row, j = p - i * packs_per_row;
    const int64_t row = index[i];
    Vec<scalar_t, kVec> result;
    if (row < 0 || row >= count) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) result.v[e] = static_cast<scalar_t>(NAN);
    } else {
      const Vec<scalar_t, kVec> xs = load_vec<scalar_t, kVec, /*kStreaming=*/false>(x + p * kVec);
      const Vec<scalar_t, kVec> bias =
          load_vec<scalar_t, kVec, /*kStreaming=*/false>(rows + (row * packs_per_row + j) * kVec);
      Vec<scalar_t, kVec> grads;
      if constexpr (kBackward) grads = load_vec<scalar_t, kVec, /*kStreaming=*/false>(grad_out + p * kVec);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        // the sum rounded to scalar_t first, as x + rows[index] is in the reference
        const acc_t pre = static_cast<acc_t>(static_cast<scalar_t>(xs.v[e] + bias.v[e]));
        if constexpr (kBackward) {
          result.v[e] = static_cast<scalar_t>(static_cast<acc_t>(grads.v[e]) * GeluMath<acc_t, kTanh>::derivative(pre));
        } else {
          result.v[e] = static_cast<scalar_t>(GeluMath<acc_t, kTanh>::value(pre));
        }
      }
    }
    store_vec(out + p * kVec, result);
  }
}

template <bool kBackward>
at::Tensor gelu_rows_cuda_impl(const at::Tensor* grad_out_in, const at::Tensor& x_in, const at::Tensor& rows_in,
                               const at::Tensor& index_in, c10::string_view approximate, const char* op) {
  const GeluRowsArgs args =
      prepare_gelu_rows(kBackward ? grad_out_in : nullptr, x_in, rows_in, index_in, approximate, at::kCUDA, op);
  const at::Tensor &x = args.x, &rows = args.rows, &index = args.index, &grad_out = args.grad_out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(0), width = x.size(1), count = rows.size(0);
  if (n == 0 || width == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gelu_rows_cuda", [&] {
    const scalar_t* g = kBackward ? grad_out.const_data_ptr<scalar_t>() : nullptr;
    constexpr int kWide = kPackBytes / sizeof(scalar_t);
    bool wide = width % kWide == 0 && aligned_to(x.const_data_ptr<scalar_t>(), kPackBytes) &&
                aligned_to(rows.const_data_ptr<scalar_t>(), kPackBytes) &&
                aligned_to(out.data_ptr<scalar_t>(), kPackBytes);
    if (kBackward) wide = wide && aligned_to(g, kPackBytes);
    dispatch_gelu_approximate(args.mode, [&](auto tanh_tag) {
      auto launch = [&](auto kernel, int64_t vec) {
        const int64_t packs = n * width / vec;
        const int64_t blocks = std::min<int64_t>((packs + kThreads - 1) / kThreads, int64_t(1) << 20);
        kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            g, x.const_data_ptr<scalar_t>(), rows.const_data_ptr<scalar_t>(), index.const_data_ptr<int64_t>(),
            out.data_ptr<scalar_t>(), packs, width / vec, count);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      constexpr bool kTanh = decltype(tanh_tag)::value;
      if (wide) {
        launch(gelu_rows_kernel<kWide, kBackward, kTanh, scalar_t>, kWide);
      } else {
        launch(gelu_rows_kernel<1, kBackward, kTanh, scalar_t>, 1);
      }
    });
  });
  return out;
}

}  // namespace

at::Tensor gelu_rows_cuda(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& index,
                          c10::string_view approximate) {
  return gelu_rows_cuda_impl<false>(nullptr, x, rows, index, approximate, "gelu_rows");
}

at::Tensor gelu_rows_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& rows,
                                   const at::Tensor& index, c10::string_view approximate) {
  return gelu_rows_cuda_impl<true>(&grad_out, x, rows, index, approximate, "gelu_rows_backward");
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
