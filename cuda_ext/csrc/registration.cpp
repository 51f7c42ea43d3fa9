// The one place where ops are declared and dispatched: schemas in a single TORCH_LIBRARY block,
// one TORCH_LIBRARY_IMPL per backend. Autograd and fake (meta) kernels are registered from
// Python beside the typed wrappers (cuda_ext/trilinear.py, brick_grid.py, upsample.py, gelu.py, ...).
#include <Python.h>
#include <torch/library.h>

#include "ops.h"

// Importing cuda_ext._C loads this library, which runs the registrations below. The module
// itself exports nothing: the ops are reached through torch.ops.cuda_ext.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(cuda_ext, m) {
  m.def("trilinear_interpolate(Tensor feats, Tensor points) -> Tensor");
  // Gradients that were not requested come back as empty tensors (shape (0,)). A lookup's backward given
  // `grad_into` adds the table's gradient onto it instead and returns (0,) in its place.
  m.def(
      "trilinear_interpolate_backward(Tensor grad_out, Tensor feats, Tensor points, "
      "bool feats_requires_grad, bool points_requires_grad) -> (Tensor, Tensor)");
  m.def("grid_interpolate(Tensor grid, Tensor points) -> Tensor");
  m.def(
      "grid_interpolate_backward(Tensor grad_out, Tensor grid, Tensor points, "
      "bool grid_requires_grad, bool points_requires_grad, Tensor(a!)? grad_into=None) -> (Tensor, Tensor)");
  m.def("brick_grid_interpolate(Tensor values, Tensor table, Tensor points, int[] shape, int brick) -> Tensor");
  m.def(
      "brick_grid_interpolate_backward(Tensor grad_out, Tensor values, Tensor table, Tensor points, int[] shape, "
      "int brick, bool values_requires_grad, bool points_requires_grad, Tensor(a!)? grad_into=None) "
      "-> (Tensor, Tensor)");
  m.def("upsample_bilinear2d(Tensor x, int scale_factor, bool align_corners) -> Tensor");
  m.def(
      "upsample_bilinear2d_backward(Tensor grad_out, int input_height, int input_width, "
      "int scale_factor, bool align_corners) -> Tensor");
  m.def("gelu(Tensor x, str approximate) -> Tensor");
  m.def("gelu_backward(Tensor grad_out, Tensor x, str approximate) -> Tensor");
  m.def("gelu_rows(Tensor x, Tensor rows, Tensor index, str approximate) -> Tensor");
  m.def(
      "gelu_rows_backward(Tensor grad_out, Tensor x, Tensor rows, Tensor index, str approximate) -> (Tensor, Tensor)");
  m.def(
      "volume_render(Tensor optical_depth, Tensor values, Tensor t, Tensor ray_offsets, float early_stop) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "volume_render_backward(Tensor grad_values, Tensor grad_opacity, Tensor grad_depth, Tensor optical_depth, "
      "Tensor values, Tensor t, Tensor ray_offsets, Tensor out, Tensor opacity, Tensor depth, float early_stop) "
      "-> (Tensor, Tensor)");
  m.def("distortion_loss(Tensor optical_depth, Tensor t_start, Tensor t_end, Tensor ray_offsets) -> Tensor");
  m.def(
      "distortion_loss_backward(Tensor grad, Tensor optical_depth, Tensor t_start, Tensor t_end, "
      "Tensor ray_offsets) -> Tensor");
  m.def(
      "visible_samples(Tensor optical_depth, Tensor ray_offsets, float early_termination, float weight_threshold, "
      "Tensor? start_depth=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "visible_samples_capped(Tensor optical_depth, Tensor ray_offsets, float early_termination, "
      "float weight_threshold, int alive_capacity, int shown_capacity, Tensor? start_depth=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "march_rays(Tensor origins, Tensor directions, Tensor t_start, Tensor t_end, Tensor offset, "
      "Tensor occupancy, Tensor box, float step, int max_samples, Tensor? t_split=None, int[]? slab=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "march_rays_capped(Tensor origins, Tensor directions, Tensor t_start, Tensor t_end, Tensor offset, "
      "Tensor occupancy, Tensor box, float step, int max_samples, int capacity, Tensor? t_split=None, "
      "int[]? slab=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "sparse_adam_step(Tensor(a!) param, Tensor(d!) grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor rows, "
      "int step, float lr, float beta1, float beta2, float eps, bool clear_grad=False) -> ()");
  m.def(
      "masked_adam_step(Tensor(a!) param, Tensor(d!) grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, int step, "
      "float lr, float beta1, float beta2, float eps, bool clear_grad=False) -> ()");
  m.def(
      "sampled_tv(Tensor(a!) grad, Tensor values, Tensor cells, int[] shape, int[] inside, float outside, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(cuda_ext, CPU, m) {
  m.impl("trilinear_interpolate", &cuda_ext::trilinear_interpolate_cpu);
  m.impl("trilinear_interpolate_backward", &cuda_ext::trilinear_interpolate_backward_cpu);
  m.impl("grid_interpolate", &cuda_ext::grid_interpolate_cpu);
  m.impl("grid_interpolate_backward", &cuda_ext::grid_interpolate_backward_cpu);
  m.impl("brick_grid_interpolate", &cuda_ext::brick_grid_interpolate_cpu);
  m.impl("brick_grid_interpolate_backward", &cuda_ext::brick_grid_interpolate_backward_cpu);
  m.impl("upsample_bilinear2d", &cuda_ext::upsample_bilinear2d_cpu);
  m.impl("upsample_bilinear2d_backward", &cuda_ext::upsample_bilinear2d_backward_cpu);
  m.impl("gelu", &cuda_ext::gelu_cpu);
  m.impl("gelu_backward", &cuda_ext::gelu_backward_cpu);
  m.impl("gelu_rows", &cuda_ext::gelu_rows_cpu);
  m.impl("gelu_rows_backward", &cuda_ext::gelu_rows_backward_cpu);
  m.impl("volume_render", &cuda_ext::volume_render_cpu);
  m.impl("volume_render_backward", &cuda_ext::volume_render_backward_cpu);
  m.impl("distortion_loss", &cuda_ext::distortion_loss_cpu);
  m.impl("distortion_loss_backward", &cuda_ext::distortion_loss_backward_cpu);
  m.impl("visible_samples", &cuda_ext::visible_samples_cpu);
  m.impl("visible_samples_capped", &cuda_ext::visible_samples_capped_cpu);
  m.impl("march_rays", &cuda_ext::march_rays_cpu);
  m.impl("march_rays_capped", &cuda_ext::march_rays_capped_cpu);
  m.impl("sparse_adam_step", &cuda_ext::sparse_adam_step_cpu);
  m.impl("masked_adam_step", &cuda_ext::masked_adam_step_cpu);
  m.impl("sampled_tv", &cuda_ext::sampled_tv_cpu);
}

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(cuda_ext, CUDA, m) {
  m.impl("trilinear_interpolate", &cuda_ext::trilinear_interpolate_cuda);
  m.impl("trilinear_interpolate_backward", &cuda_ext::trilinear_interpolate_backward_cuda);
  m.impl("grid_interpolate", &cuda_ext::grid_interpolate_cuda);
  m.impl("grid_interpolate_backward", &cuda_ext::grid_interpolate_backward_cuda);
  m.impl("brick_grid_interpolate", &cuda_ext::brick_grid_interpolate_cuda);
  m.impl("brick_grid_interpolate_backward", &cuda_ext::brick_grid_interpolate_backward_cuda);
  m.impl("upsample_bilinear2d", &cuda_ext::upsample_bilinear2d_cuda);
  m.impl("upsample_bilinear2d_backward", &cuda_ext::upsample_bilinear2d_backward_cuda);
  m.impl("gelu", &cuda_ext::gelu_cuda);
  m.impl("gelu_backward", &cuda_ext::gelu_backward_cuda);
  m.impl("gelu_rows", &cuda_ext::gelu_rows_cuda);
  m.impl("gelu_rows_backward", &cuda_ext::gelu_rows_backward_cuda);
  m.impl("volume_render", &cuda_ext::volume_render_cuda);
  m.impl("volume_render_backward", &cuda_ext::volume_render_backward_cuda);
  m.impl("distortion_loss", &cuda_ext::distortion_loss_cuda);
  m.impl("distortion_loss_backward", &cuda_ext::distortion_loss_backward_cuda);
  m.impl("visible_samples", &cuda_ext::visible_samples_cuda);
  m.impl("visible_samples_capped", &cuda_ext::visible_samples_capped_cuda);
  m.impl("march_rays", &cuda_ext::march_rays_cuda);
  m.impl("march_rays_capped", &cuda_ext::march_rays_capped_cuda);
  m.impl("sparse_adam_step", &cuda_ext::sparse_adam_step_cuda);
  m.impl("masked_adam_step", &cuda_ext::masked_adam_step_cuda);
  m.impl("sampled_tv", &cuda_ext::sampled_tv_cuda);
}
#endif
