// sparse_adam_step: torch.optim.Adam's update (no weight decay, no amsgrad) applied to the listed rows of a
// (M, C) parameter only, in place, with its gradient and moments. Argument checks and the per-element math,
// shared by the CPU kernel (cpu/adam.cpp) and the CUDA kernel (cuda/adam.cu).
#pragma once

#include <cmath>

#include "kernel_common.h"

namespace cuda_ext {

inline void check_adam_inputs(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                              const at::Tensor& exp_avg_sq, const at::Tensor& rows, int64_t step, double lr,
                              double beta1, double beta2, double eps, at::DeviceType device) {
  const char* op = "sparse_adam_step";
  TORCH_CHECK(param.dim() == 2, op, ": param must have shape (M, C), got ", param.sizes());
  check_device_type(param, "param", device, op);
  TORCH_CHECK(param.scalar_type() == at::kFloat || param.scalar_type() == at::kDouble, op,
              ": param must be float32 or float64, got ", param.scalar_type());
  TORCH_CHECK(param.is_contiguous(), op, ": param must be contiguous (it is updated in place)");
  const std::pair<const at::Tensor*, const char*> others[] = {
      {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}};
  for (const auto& [tensor, name] : others) {
    TORCH_CHECK(tensor->sizes() == param.sizes(), op, ": ", name, " must have the shape of param ", param.sizes(),
                ", got ", tensor->sizes());
    check_same_device_and_dtype(*tensor, param, op, name, "param");
    TORCH_CHECK(tensor->is_contiguous(), op, ": ", name, " must be contiguous");
  }
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, op, ": rows must be a (K,) int64 tensor, got ",
              rows.scalar_type(), " of shape ", rows.sizes());
  TORCH_CHECK(rows.device() == param.device(), op, ": rows must be on param's device (", param.device(), "), got ",
              rows.device());
  TORCH_CHECK(step >= 1, op, ": step must be >= 1, got ", step);
  TORCH_CHECK(lr >= 0, op, ": lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, op, ": beta1 and beta2 must be in [0, 1), got ",
              beta1, " and ", beta2);
  TORCH_CHECK(eps > 0, op, ": eps must be > 0, got ", eps);
}

// The step's constants, as torch.optim.Adam (single-tensor path) computes them: the bias-corrected step size
// and the second moment's bias correction, folded so each element costs one sqrt and one division.
struct AdamConstants {
  double beta1, beta2, eps, step_size, bias_correction2_sqrt;
  static AdamConstants make(int64_t step, double lr, double beta1, double beta2, double eps) {
    const double bias_correction1 = 1 - std::pow(beta1, double(step));
    const double bias_correction2 = 1 - std::pow(beta2, double(step));
    return {beta1, beta2, eps, lr / bias_correction1, std::sqrt(bias_correction2)};
  }
};

// One element: m, v and p updated in place from g.
template <typename acc_t>
CUDA_EXT_HOST_DEVICE void adam_element(acc_t& p, acc_t g, acc_t& m, acc_t& v, const AdamConstants& k) {
  m = m * acc_t(k.beta1) + g * acc_t(1 - k.beta1);
  v = v * acc_t(k.beta2) + g * g * acc_t(1 - k.beta2);
  const acc_t denom = sqrt(v) / acc_t(k.bias_correction2_sqrt) + acc_t(k.eps);
  p -= acc_t(k.step_size) * m / denom;
}

}  // namespace cuda_ext
