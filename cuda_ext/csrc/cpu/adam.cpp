// The row-sparse Adam family on the CPU (adam.h). sparse_adam_step: rows' range checked first (so a bad call
// changes nothing), then the listed rows split across threads (at::parallel_for), each row's C contiguous
// elements updated in place (then, with clear_grad, the row's gradient set to zero); work and memory traffic
// follow K, the rows listed, never M. masked_adam_step: the
// M * C elements split across threads, each stepped where its gradient is non-zero (then, with clear_grad, the
// task's gradient elements set to zero).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "adam.h"
#include "ops.h"

// As in cpu/gelu.cpp: an x86-64-v3 build (FMA in hardware, so adam_element's fma is one instruction rather than
// a libm call) picked at load time where the CPU has it, and a baseline build beside it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__GLIBC__)
#define CUDA_EXT_ADAM_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CUDA_EXT_ADAM_CLONES
#endif

namespace cuda_ext {
namespace {

constexpr int64_t kGrainElements = 16384;  // elements per task: enough to amortise scheduling

// Rows index[begin..end) of the (M, channels) arrays, updated in place; with `clear` their gradient zeroed after.
template <typename scalar_t>
CUDA_EXT_ADAM_CLONES void adam_rows(scalar_t* __restrict p, scalar_t* __restrict g, scalar_t* __restrict m,
                                    scalar_t* __restrict v, const int64_t* __restrict index, int64_t begin, int64_t end,
                                    int64_t channels, const AdamCoefficients<scalar_t>& k, bool clear) {
  for (int64_t r = begin; r < end; ++r) {
    const int64_t base = index[r] * channels;
#pragma omp simd
    for (int64_t c = base; c < base + channels; ++c) adam_element<scalar_t>(p[c], g[c], m[c], v[c], k);
    if (clear) std::fill(g + base, g + base + channels, scalar_t(0));
  }
}

// Elements [begin, end) of the flat arrays, each stepped where its gradient is non-zero.
template <typename scalar_t>
CUDA_EXT_ADAM_CLONES void masked_elements(scalar_t* __restrict p, const scalar_t* __restrict g, scalar_t* __restrict m,
                                          scalar_t* __restrict v, int64_t begin, int64_t end,
                                          const AdamCoefficients<scalar_t>& k) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) masked_adam_element<scalar_t>(p[i], g[i], m[i], v[i], k);
}

}  // namespace

void sparse_adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const at::Tensor& rows_in, int64_t step, double lr,
                          double beta1, double beta2, double eps, bool clear_grad) {
  check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows_in, step, lr, beta1, beta2, eps, at::kCPU);
  const at::Tensor rows = rows_in.contiguous();
  const int64_t k_rows = rows.size(0), m_rows = param.size(0), channels = param.size(1);
  const int64_t* index = rows.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < k_rows; ++r) {
    TORCH_CHECK(index[r] >= 0 && index[r] < m_rows, "sparse_adam_step: rows must lie in [0, ", m_rows, "), got ",
                index[r], " at position ", r);
  }
  if (k_rows == 0 || channels == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / channels);
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "sparse_adam_step_cpu", [&] {
    const auto k = AdamCoefficients<scalar_t>::make(step, lr, beta1, beta2, eps);
    scalar_t* p = param.data_ptr<scalar_t>();
    scalar_t* m = exp_avg.data_ptr<scalar_t>();
    scalar_t* v = exp_avg_sq.data_ptr<scalar_t>();
    scalar_t* g = grad.data_ptr<scalar_t>();
    at::parallel_for(0, k_rows, grain, [&](int64_t begin, int64_t end) {
      adam_rows<scalar_t>(p, g, m, v, index, begin, end, channels, k, clear_grad);
    });
  });
}

void masked_adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps,
                          bool clear_grad) {
  check_masked_adam_inputs(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, at::kCPU);
  const int64_t elements = param.numel();
  if (elements == 0) return;
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "masked_adam_step_cpu", [&] {
    const auto k = AdamCoefficients<scalar_t>::make(step, lr, beta1, beta2, eps);
    scalar_t* p = param.data_ptr<scalar_t>();
    scalar_t* m = exp_avg.data_ptr<scalar_t>();
    scalar_t* v = exp_avg_sq.data_ptr<scalar_t>();
    scalar_t* g = grad.data_ptr<scalar_t>();
    at::parallel_for(0, elements, kGrainElements, [&](int64_t begin, int64_t end) {
      masked_elements<scalar_t>(p, g, m, v, begin, end, k);
      if (clear_grad) std::fill(g + begin, g + end, scalar_t(0));
    });
  });
}

}  // namespace cuda_ext
