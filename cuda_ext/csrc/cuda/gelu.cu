// STUB: replaced by the GELU implementation.
#include "ops.h"
#include <c10/util/Exception.h>
namespace cuda_ext {
at::Tensor gelu_cuda(const at::Tensor&, c10::string_view) { TORCH_CHECK(false, "gelu: CUDA kernel not written yet"); }
at::Tensor gelu_backward_cuda(const at::Tensor&, const at::Tensor&, c10::string_view) { TORCH_CHECK(false, "gelu_backward: CUDA kernel not written yet"); }
}  // namespace cuda_ext
