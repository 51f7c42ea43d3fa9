// STUB: replaced by the trilinear-family implementation.
#include "ops.h"
#include <c10/util/Exception.h>
namespace cuda_ext {
at::Tensor trilinear_interpolate_cpu(const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "trilinear_interpolate: CPU kernel not written yet"); }
std::tuple<at::Tensor, at::Tensor> trilinear_interpolate_backward_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool) { TORCH_CHECK(false, "trilinear_interpolate_backward: CPU kernel not written yet"); }
at::Tensor grid_interpolate_cpu(const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "grid_interpolate: CPU kernel not written yet"); }
std::tuple<at::Tensor, at::Tensor> grid_interpolate_backward_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool) { TORCH_CHECK(false, "grid_interpolate_backward: CPU kernel not written yet"); }
}  // namespace cuda_ext
