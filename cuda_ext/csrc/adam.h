// The row-sparse Adam family, in place on a (M, C) parameter and its moments. Argument checks, constants and the
// per-element math, shared by the CPU kernels (cpu/adam.cpp) and the CUDA kernels (cuda/adam.cu):
// - sparse_adam_step: torch.optim.Adam's update (no weight decay, no amsgrad) on the listed rows only;
// - masked_adam_step: the same update on the elements whose gradient is non-zero (a zero leaves the value and both
//   moments as they were: DirectVoxGO's masked Adam), over the whole parameter, with no list of rows.
#pragma once

#include <cmath>
#include <initializer_list>
#include <utility>

#include "kernel_common.h"

namespace cuda_ext {

// param: (M, C) float32/float64, contiguous (updated in place), on the running kernel's backend; each of
// `others` (tensor, name): param's shape, device and dtype, contiguous.
inline void check_row_state(const at::Tensor& param,
                            std::initializer_list<std::pair<const at::Tensor*, const char*>> others,
                            at::DeviceType device, const char* op) {
  TORCH_CHECK(param.dim() == 2, op, ": param must have shape (M, C), got ", param.sizes());
  check_device_type(param, "param", device, op);
  TORCH_CHECK(param.scalar_type() == at::kFloat || param.scalar_type() == at::kDouble, op,
              ": param must be float32 or float64, got ", param.scalar_type());
  TORCH_CHECK(param.is_contiguous(), op, ": param must be contiguous (it is updated in place)");
  for (const auto& [tensor, name] : others) {
    TORCH_CHECK(tensor->sizes() == param.sizes(), op, ": ", name, " must have the shape of param ", param.sizes(),
                ", got ", tensor->sizes());
    check_same_device_and_dtype(*tensor, param, op, name, "param");
    TORCH_CHECK(tensor->is_contiguous(), op, ": ", name, " must be contiguous");
  }
}

// step, lr, betas and eps of the Adam steps (sparse_adam_step, masked_adam_step).
inline void check_adam_numbers(int64_t step, double lr, double beta1, double beta2, double eps, const char* op) {
  TORCH_CHECK(step >= 1, op, ": step must be >= 1, got ", step);
  TORCH_CHECK(lr >= 0 && std::isfinite(lr), op, ": lr must be in [0, inf), got ", lr);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps > 0 && std::isfinite(eps), op, ": eps must be a number > 0, got ", eps);
}

// The backstop for direct torch.ops.cuda_ext calls (the Python wrapper checks the same, with the same words).
// rows' values (range, uniqueness) are not read here: the CPU kernel checks the range as it goes, the CUDA
// kernel skips rows out of range (the wrapper rejects them before the launch).
inline void check_adam_inputs(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                              const at::Tensor& exp_avg_sq, const at::Tensor& rows, int64_t step, double lr,
                              double beta1, double beta2, double eps, at::DeviceType device) {
  const char* op = "sparse_adam_step";
  check_row_state(param, {{&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}}, device, op);
  TORCH_CHECK(rows.dim() == 1, op, ": rows must have shape (K,), got ", rows.sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong, op, ": rows must be int64, got ", rows.scalar_type());
  TORCH_CHECK(rows.device() == param.device(), op, ": rows and param must be on the same device, got ", rows.device(),
              " and ", param.device());
  check_adam_numbers(step, lr, beta1, beta2, eps, op);
}

inline void check_masked_adam_inputs(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                     const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                                     double eps, at::DeviceType device) {
  const char* op = "masked_adam_step";
  check_row_state(param, {{&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}}, device, op);
  check_adam_numbers(step, lr, beta1, beta2, eps, op);
}

// The step's constants in the element type, made as torch.optim.Adam's single-tensor path makes them: the bias
// corrections, lr / bias_correction1 and bias_correction2 ** 0.5 in double (Python floats), then every scalar
// rounded to the tensors' dtype where the tensor op takes it.
template <typename T>
struct AdamCoefficients {
  T lerp_weight;            // 1 - beta1: exp_avg.lerp_(grad, 1 - beta1)
  bool small_weight;        // |lerp_weight| < 0.5: lerp's two formulas (ATen's at::native::lerp)
  T beta2;                  // exp_avg_sq.mul_(beta2)
  T one_minus_beta2;        // .addcmul_(grad, grad, value=1 - beta2)
  T bias_correction2_sqrt;  // exp_avg_sq.sqrt() / bias_correction2_sqrt
  T eps;                    // .add_(eps)
  T neg_step_size;          // param.addcdiv_(exp_avg, denom, value=-step_size)

  static AdamCoefficients make(int64_t step, double lr, double beta1, double beta2, double eps) {
    const double bias_correction1 = 1 - std::pow(beta1, double(step));
    const double bias_correction2 = 1 - std::pow(beta2, double(step));
    const double step_size = lr / bias_correction1;
    const T weight = static_cast<T>(1 - beta1);
    return {weight,
            std::abs(weight) < T(0.5),
            static_cast<T>(beta2),
            static_cast<T>(1 - beta2),
            static_cast<T>(std::pow(bias_correction2, 0.5)),
            static_cast<T>(eps),
            static_cast<T>(-step_size)};
  }
};

// One element, in torch's op order (each line is one tensor op of _single_tensor_adam; ATen's CPU vector code
// and nvcc both fuse lerp's and addcmul's multiply-add, hence the fma):
//   m = lerp(m, g, 1 - beta1); v = v * beta2 + (1 - beta2) * g * g;
//   p = p + (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps).
template <typename T>
CUDA_EXT_HOST_DEVICE void adam_element(T& p, T g, T& m, T& v, const AdamCoefficients<T>& k) {
  using std::fma;
  using std::sqrt;
  const T diff = g - m;
  m = k.small_weight ? fma(k.lerp_weight, diff, m) : fma(k.lerp_weight - T(1), diff, g);
  v = fma(k.one_minus_beta2 * g, g, v * k.beta2);
  const T denom = sqrt(v) / k.bias_correction2_sqrt + k.eps;
  p = p + (k.neg_step_size * m) / denom;
}

// masked_adam_step's element: adam_element where the gradient is non-zero (NaN counts: it spreads as in dense
// Adam); an exact zero leaves p, m and v as they were.
template <typename T>
CUDA_EXT_HOST_DEVICE void masked_adam_element(T& p, T g, T& m, T& v, const AdamCoefficients<T>& k) {
  if (g != T(0)) adam_element<T>(p, g, m, v, k);
}

}  // namespace cuda_ext
