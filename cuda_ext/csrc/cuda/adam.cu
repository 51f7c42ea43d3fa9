// sparse_adam_step on CUDA: a grid-stride loop over the K*C elements of the listed rows. Consecutive threads
// take consecutive elements, so the C channels of a row (contiguous in param, grad and both moments) are read
// and written by neighbouring lanes: each row is one coalesced run, and the time follows K, not M.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "adam.h"
#include "kernel_common.h"
#include "ops.h"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    sparse_adam_kernel(scalar_t* __restrict__ p, const scalar_t* __restrict__ g, scalar_t* __restrict__ m,
                       scalar_t* __restrict__ v, const int64_t* __restrict__ rows, int64_t k_rows, int64_t m_rows,
                       int64_t channels, AdamConstants k) {
  const int64_t total = k_rows * channels;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / channels;
    const int64_t row = rows[r];
    if (row < 0 || row >= m_rows) continue;
    const int64_t i = row * channels + (e - r * channels);
    scalar_t pi = p[i], mi = m[i], vi = v[i];
    adam_element<scalar_t>(pi, g[i], mi, vi, k);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

void sparse_adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq, const at::Tensor& rows_in, int64_t step, double lr,
                           double beta1, double beta2, double eps) {
  check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows_in, step, lr, beta1, beta2, eps, at::kCUDA);
  const c10::cuda::CUDAGuard device_guard(param.device());
  const at::Tensor rows = rows_in.contiguous();
  const int64_t total = rows.size(0) * param.size(1);
  if (total == 0) return;
  const AdamConstants k = AdamConstants::make(step, lr, beta1, beta2, eps);
  AT_DISPATCH_FLOATING_TYPES(param.scalar_type(), "sparse_adam_step_cuda", [&] {
    const int blocks =
        std::min<int64_t>((total + kThreads - 1) / kThreads, resident_blocks(sparse_adam_kernel<scalar_t>, kThreads));
    sparse_adam_kernel<scalar_t><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        param.data_ptr<scalar_t>(), grad.const_data_ptr<scalar_t>(), exp_avg.data_ptr<scalar_t>(),
        exp_avg_sq.data_ptr<scalar_t>(), rows.const_data_ptr<int64_t>(), rows.size(0), param.size(0), param.size(1), k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda_ext
