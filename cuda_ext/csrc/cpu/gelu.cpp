// GELU on the CPU: one pass over contiguous memory, split across threads by at::parallel_for. float
// computes in FastFloat (inline exp/erf/tanh), so each thread's span is one vectorised loop, built
// for AVX2+FMA and for baseline x86-64 and picked at load time; double keeps libm's accuracy.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "cpu/fast_float.h"
#include "gelu.h"
#include "ops.h"

// Function multiversioning (GCC >= 11, x86-64, glibc's ifunc): the loader picks the x86-64-v3 build
// (AVX2 + FMA: 8 lanes) where the CPU has it. (GCC 12 leaves an "arch=haswell" clone scalar.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__GLIBC__)
#define CUDA_EXT_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CUDA_EXT_SIMD_CLONES
#endif

namespace cuda_ext {
namespace {

constexpr int64_t kGrain = 16384;  // elements per task: enough to amortise scheduling, small enough to split

template <typename scalar_t>
using CpuMathType = std::conditional_t<std::is_same<scalar_t, float>::value, FastFloat, scalar_t>;

inline float plain(FastFloat x) { return x.v; }
inline double plain(double x) { return x; }

// y[0..n) = gelu(x[0..n))
template <typename scalar_t, bool kTanh>
CUDA_EXT_SIMD_CLONES void gelu_span(const scalar_t* __restrict x, scalar_t* __restrict y, int64_t n) {
  using acc_t = CpuMathType<scalar_t>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = plain(GeluMath<acc_t, kTanh>::value(acc_t(x[i])));
}

// grad_x[0..n) = grad_out * gelu'(x)
template <typename scalar_t, bool kTanh>
CUDA_EXT_SIMD_CLONES void gelu_backward_span(const scalar_t* __restrict grad_out, const scalar_t* __restrict x,
                                             scalar_t* __restrict grad_x, int64_t n) {
  using acc_t = CpuMathType<scalar_t>;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    grad_x[i] = plain(acc_t(grad_out[i]) * GeluMath<acc_t, kTanh>::derivative(acc_t(x[i])));
  }
}

// The rows ops: the pre-activation of row i is x[i] + rows[index[i]]; each task takes whole rows.
template <typename scalar_t, bool kTanh, bool kBackward>
void gelu_rows_span(const scalar_t* grad_out, const scalar_t* x, const scalar_t* rows, const int64_t* index,
                    scalar_t* out, int64_t begin, int64_t end, int64_t width) {
  using acc_t = CpuMathType<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    const scalar_t* bias = rows + index[i] * width;
    const scalar_t* xi = x + i * width;
    scalar_t* oi = out + i * width;
    if constexpr (kBackward) {
      const scalar_t* gi = grad_out + i * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        oi[j] = plain(acc_t(gi[j]) * GeluMath<acc_t, kTanh>::derivative(acc_t(xi[j] + bias[j])));
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) oi[j] = plain(GeluMath<acc_t, kTanh>::value(acc_t(xi[j] + bias[j])));
    }
  }
}

// Both rows ops: checks, the index range (host memory: checked before anything is written), then the spans.
template <bool kBackward>
at::Tensor gelu_rows_cpu_impl(const at::Tensor* grad_out_in, const at::Tensor& x_in, const at::Tensor& rows_in,
                              const at::Tensor& index_in, c10::string_view approximate, const char* op) {
  const GeluRowsArgs args =
      prepare_gelu_rows(kBackward ? grad_out_in : nullptr, x_in, rows_in, index_in, approximate, at::kCPU, op);
  const at::Tensor &x = args.x, &rows = args.rows, &index = args.index, &grad_out = args.grad_out;
  const int64_t n = x.size(0), width = x.size(1), count = rows.size(0);
  const int64_t* idx = index.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < count, op, ": index[", i, "] = ", idx[i], " is outside [0, ", count,
                ") (rows has ", count, " rows)");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (n == 0 || width == 0) return out;
  const int64_t grain = std::max<int64_t>(1, kGrain / width);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_rows_cpu", [&] {
    const scalar_t* g = kBackward ? grad_out.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* xs = x.const_data_ptr<scalar_t>();
    const scalar_t* rs = rows.const_data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    dispatch_gelu_approximate(args.mode, [&](auto tanh_tag) {
      at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
        gelu_rows_span<scalar_t, decltype(tanh_tag)::value, kBackward>(g, xs, rs, idx, dst, begin, end, width);
      });
    });
  });
  return out;
}

// sums[index[i]] += grad_x[i] for every sample i, in sample order; the columns are split across threads, so no two
// threads add into one element and the result does not depend on the thread count.
template <typename scalar_t>
void sum_rows(const scalar_t* grad_x, const int64_t* index, scalar_t* sums, int64_t n, int64_t width) {
  at::parallel_for(0, width, std::max<int64_t>(1, kGrain / n), [&](int64_t begin, int64_t end) {
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t* gi = grad_x + i * width;
      scalar_t* si = sums + index[i] * width;
      for (int64_t j = begin; j < end; ++j) si[j] += gi[j];
    }
  });
}

}  // namespace

at::Tensor gelu_rows_cpu(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& index,
                         c10::string_view approximate) {
  return gelu_rows_cpu_impl<false>(nullptr, x, rows, index, approximate, "gelu_rows");
}

std::tuple<at::Tensor, at::Tensor> gelu_rows_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                          const at::Tensor& rows, const at::Tensor& index,
                                                          c10::string_view approximate) {
  at::Tensor grad_x = gelu_rows_cpu_impl<true>(&grad_out, x, rows, index, approximate, "gelu_rows_backward");
  // x's dtype is float or double here: the sums are kept in it (the CUDA kernel's float for half types)
  at::Tensor grad_rows = at::zeros(rows.sizes(), rows.options());
  const int64_t n = x.size(0), width = x.size(1);
  if (n == 0 || width == 0) return {grad_x, grad_rows};
  const at::Tensor idx = index.contiguous();  // its values were checked by the impl, before anything was written
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_rows_backward_cpu", [&] {
    sum_rows<scalar_t>(grad_x.const_data_ptr<scalar_t>(), idx.const_data_ptr<int64_t>(), grad_rows.data_ptr<scalar_t>(),
                       n, width);
  });
  return {grad_x, grad_rows};
}

at::Tensor gelu_cpu(const at::Tensor& x_in, c10::string_view approximate) {
  const GeluApproximate mode = parse_gelu_approximate(approximate);
  check_gelu_input(x_in, "gelu");
  const at::Tensor x = contiguous_on(x_in, "x", at::kCPU, "gelu");
  at::Tensor y = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_cpu", [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = y.data_ptr<scalar_t>();
    dispatch_gelu_approximate(mode, [&](auto tanh_tag) {
      at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
        gelu_span<scalar_t, decltype(tanh_tag)::value>(src + begin, dst + begin, end - begin);
      });
    });
  });
  return y;
}

at::Tensor gelu_backward_cpu(const at::Tensor& grad_out_in, const at::Tensor& x_in, c10::string_view approximate) {
  const GeluApproximate mode = parse_gelu_approximate(approximate);
  check_gelu_backward_inputs(grad_out_in, x_in);
  const at::Tensor x = contiguous_on(x_in, "x", at::kCPU, "gelu_backward");
  const at::Tensor grad_out = contiguous_on(grad_out_in, "grad_out", at::kCPU, "gelu_backward");
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_backward_cpu", [&] {
    const scalar_t* xs = x.const_data_ptr<scalar_t>();
    const scalar_t* gs = grad_out.const_data_ptr<scalar_t>();
    scalar_t* dst = grad_x.data_ptr<scalar_t>();
    dispatch_gelu_approximate(mode, [&](auto tanh_tag) {
      at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
        gelu_backward_span<scalar_t, decltype(tanh_tag)::value>(gs + begin, xs + begin, dst + begin, end - begin);
      });
    });
  });
  return grad_x;
}

}  // namespace cuda_ext
