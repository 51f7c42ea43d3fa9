// GELU on the CPU: one pass over contiguous memory, split across threads by at::parallel_for.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "gelu.h"
#include "ops.h"

namespace cuda_ext {
namespace {

constexpr int64_t kGrain = 16384;  // elements per task: enough to amortise scheduling, small enough to split

at::Tensor check_cpu(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, " must be a CPU tensor here, got ", t.device());
  return t.contiguous();
}

}  // namespace

at::Tensor gelu_cpu(const at::Tensor& x_in, c10::string_view approximate) {
  const GeluApproximate mode = parse_gelu_approximate(approximate);
  check_gelu_input(x_in, "gelu");
  const at::Tensor x = check_cpu(x_in, "gelu", "x");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_cpu", [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    scalar_t* dst = y.data_ptr<scalar_t>();
    dispatch_gelu_approximate(mode, [&](auto tanh_tag) {
      using Math = GeluMath<scalar_t, decltype(tanh_tag)::value>;
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) dst[i] = Math::value(src[i]);
      });
    });
  });
  return y;
}

at::Tensor gelu_backward_cpu(const at::Tensor& grad_out_in, const at::Tensor& x_in, c10::string_view approximate) {
  const GeluApproximate mode = parse_gelu_approximate(approximate);
  check_gelu_backward_inputs(grad_out_in, x_in);
  const at::Tensor x = check_cpu(x_in, "gelu_backward", "x");
  const at::Tensor grad_out = check_cpu(grad_out_in, "gelu_backward", "grad_out");
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  const int64_t n = x.numel();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_backward_cpu", [&] {
    const scalar_t* xs = x.const_data_ptr<scalar_t>();
    const scalar_t* gs = grad_out.const_data_ptr<scalar_t>();
    scalar_t* dst = grad_x.data_ptr<scalar_t>();
    dispatch_gelu_approximate(mode, [&](auto tanh_tag) {
      using Math = GeluMath<scalar_t, decltype(tanh_tag)::value>;
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) dst[i] = gs[i] * Math::derivative(xs[i]);
      });
    });
  });
  return grad_x;
}

}  // namespace cuda_ext
