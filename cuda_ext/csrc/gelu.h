// GELU, exact (erf) or tanh approximation: argument checks and the scalar math, shared by the CPU
// kernel (cpu/gelu.cpp) and the CUDA kernel (cuda/gelu.cu). Formulas follow F.gelu.
#pragma once

#include <cmath>
#include <type_traits>

#include "kernel_common.h"

namespace cuda_ext {

enum class GeluApproximate { kNone, kTanh };

inline GeluApproximate parse_gelu_approximate(c10::string_view approximate) {
  if (approximate == "none") return GeluApproximate::kNone;
  TORCH_CHECK(approximate == "tanh", "gelu: approximate must be \"none\" or \"tanh\", got \"", approximate, "\"");
  return GeluApproximate::kTanh;
}

inline void check_gelu_input(const at::Tensor& x, const char* op) { check_floating_dtype(x, op, "x"); }

inline void check_gelu_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x) {
  check_gelu_input(x, "gelu_backward");
  check_same_device_and_dtype(grad_out, x, "gelu_backward", "grad_out", "x");
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "gelu_backward: grad_out must have the shape of x ", x.sizes(), ", got ",
              grad_out.sizes());
}

// gelu_rows: x (N, H), rows (B, H) of x's dtype and device, index (N,) int64 on that device (values in [0, B):
// checked on the CPU; on CUDA, where reading them would cost a host sync, an output row whose index is out of
// range comes out NaN). grad_out (the backward's; nullptr for the forward) has the shape, dtype and device of x.
inline void check_gelu_rows_inputs(const at::Tensor* grad_out, const at::Tensor& x, const at::Tensor& rows,
                                   const at::Tensor& index, const char* op) {
  check_gelu_input(x, op);
  if (grad_out != nullptr) {
    check_same_device_and_dtype(*grad_out, x, op, "grad_out", "x");
    TORCH_CHECK(grad_out->sizes() == x.sizes(), op, ": grad_out must have the shape of x ", x.sizes(), ", got ",
                grad_out->sizes());
  }
  check_same_device_and_dtype(rows, x, op, "rows", "x");
  TORCH_CHECK(x.dim() == 2, op, ": x must have shape (N, H), got ", x.sizes());
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == x.size(1), op, ": rows must have shape (B, ", x.size(1), "), got ",
              rows.sizes());
  TORCH_CHECK(index.device() == x.device(), op, ": index must be on x's device ", x.device(), ", got ", index.device());
  TORCH_CHECK(index.scalar_type() == at::kLong, op, ": index must be int64, got ", index.scalar_type());
  TORCH_CHECK(index.dim() == 1 && index.size(0) == x.size(0), op, ": index must have shape (", x.size(0), "), got ",
              index.sizes());
}

// A rows op's arguments after the checks, each contiguous on the backend's device (grad_out undefined for the
// forward): what both backends' kernels read.
struct GeluRowsArgs {
  GeluApproximate mode;
  at::Tensor grad_out, x, rows, index;
};

inline GeluRowsArgs prepare_gelu_rows(const at::Tensor* grad_out, const at::Tensor& x, const at::Tensor& rows,
                                      const at::Tensor& index, c10::string_view approximate, at::DeviceType device,
                                      const char* op) {
  const GeluApproximate mode = parse_gelu_approximate(approximate);
  check_gelu_rows_inputs(grad_out, x, rows, index, op);
  return {mode, grad_out != nullptr ? contiguous_on(*grad_out, "grad_out", device, op) : at::Tensor(),
          contiguous_on(x, "x", device, op), contiguous_on(rows, "rows", device, op),
          contiguous_on(index, "index", device, op)};
}

// Calls fn(std::true_type) for "tanh" and fn(std::false_type) for "none", so kernels get the mode as a
// compile-time constant instead of a branch per element.
template <typename Fn>
void dispatch_gelu_approximate(GeluApproximate approximate, Fn&& fn) {
  if (approximate == GeluApproximate::kTanh) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

// libm/CUDA math by precision: the float versions (erff, ...) are much cheaper than promoting to double.
CUDA_EXT_HOST_DEVICE float erf_of(float v) { return erff(v); }
CUDA_EXT_HOST_DEVICE double erf_of(double v) { return erf(v); }
CUDA_EXT_HOST_DEVICE float exp_of(float v) { return expf(v); }
CUDA_EXT_HOST_DEVICE double exp_of(double v) { return exp(v); }
CUDA_EXT_HOST_DEVICE float tanh_of(float v) { return tanhf(v); }
CUDA_EXT_HOST_DEVICE double tanh_of(double v) { return tanh(v); }

// acc_t is float or double: the precision the kernels compute in.
template <typename acc_t, bool kTanh>
struct GeluMath {
  static constexpr double kSqrtHalf = 0.70710678118654752440;     // 1/sqrt(2)
  static constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1/sqrt(2*pi)
  static constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2/pi)
  static constexpr double kKappa = 0.044715;

  // gelu(x)
  CUDA_EXT_HOST_DEVICE static acc_t value(acc_t x) {
    const acc_t half = acc_t(0.5), one = acc_t(1);
    if constexpr (kTanh) {
      const acc_t inner = acc_t(kSqrt2OverPi) * (x + acc_t(kKappa) * x * x * x);
      return half * x * (one + tanh_of(inner));
    } else {
      return x * half * (one + erf_of(x * acc_t(kSqrtHalf)));
    }
  }

  // d gelu / dx
  CUDA_EXT_HOST_DEVICE static acc_t derivative(acc_t x) {
    const acc_t half = acc_t(0.5), one = acc_t(1);
    if constexpr (kTanh) {
      const acc_t x_sq = x * x;
      const acc_t t = tanh_of(acc_t(kSqrt2OverPi) * (x + acc_t(kKappa) * x_sq * x));
      const acc_t d_inner = acc_t(kSqrt2OverPi) * (one + acc_t(3 * kKappa) * x_sq);
      return half * (one + t) + half * x * (one - t * t) * d_inner;
    } else {
      const acc_t cdf = half * (one + erf_of(x * acc_t(kSqrtHalf)));
      const acc_t pdf = acc_t(kInvSqrt2Pi) * exp_of(-half * x * x);
      return cdf + x * pdf;
    }
  }
};

}  // namespace cuda_ext
