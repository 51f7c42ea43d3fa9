// sparse_adam_step on the CPU: the listed rows split across threads (at::parallel_for), each row's C
// elements updated in place (adam.h). Rows out of range are skipped (the Python wrapper rejects them).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "adam.h"
#include "ops.h"

namespace cuda_ext {

void sparse_adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const at::Tensor& rows_in, int64_t step, double lr,
                          double beta1, double beta2, double eps) {
  check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows_in, step, lr, beta1, beta2, eps, at::kCPU);
  const at::Tensor rows = rows_in.contiguous();
  const AdamConstants k = AdamConstants::make(step, lr, beta1, beta2, eps);
  const int64_t m_rows = param.size(0), channels = param.size(1);
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "sparse_adam_step_cpu", [&] {
    scalar_t* p = param.data_ptr<scalar_t>();
    scalar_t* m = exp_avg.data_ptr<scalar_t>();
    scalar_t* v = exp_avg_sq.data_ptr<scalar_t>();
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const int64_t* index = rows.const_data_ptr<int64_t>();
    at::parallel_for(0, rows.size(0), 1024, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t row = index[r];
        if (row < 0 || row >= m_rows) continue;
        for (int64_t c = row * channels; c < (row + 1) * channels; ++c)
          adam_element<scalar_t>(p[c], g[c], m[c], v[c], k);
      }
    });
  });
}

}  // namespace cuda_ext
