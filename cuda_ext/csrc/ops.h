// Declarations of every kernel entry point, CPU and CUDA. registration.cpp binds them to the
// schemas; each op family implements its CPU half in cpu/<family>.cpp and its CUDA half in
// cuda/<family>*.cu. Validation and math shared by both halves live in <family>.h beside this file
// (trilinear.h, grid_interpolate.h, brick_grid.h, upsample.h, gelu.h, render.h, distortion.h, ...); kernel_common.h
// and interpolation.h hold what several families share (cuda/warp_scan.cuh: the per-ray warp scans).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace cuda_ext {

// trilinear_interpolate: the pairwise op, (N, 8, F) corner features at (N, 3) points.
at::Tensor trilinear_interpolate_cpu(const at::Tensor& feats, const at::Tensor& points);
std::tuple<at::Tensor, at::Tensor> trilinear_interpolate_backward_cpu(const at::Tensor& grad_out,
                                                                      const at::Tensor& feats, const at::Tensor& points,
                                                                      bool feats_requires_grad,
                                                                      bool points_requires_grad);

// grid_interpolate: the fused lookup in a dense channels-last (R0, R1, R2, C) grid at (N, 3) points.
at::Tensor grid_interpolate_cpu(const at::Tensor& grid, const at::Tensor& points);
std::tuple<at::Tensor, at::Tensor> grid_interpolate_backward_cpu(const at::Tensor& grad_out, const at::Tensor& grid,
                                                                 const at::Tensor& points, bool grid_requires_grad,
                                                                 bool points_requires_grad,
                                                                 const std::optional<at::Tensor>& grad_into);

// brick_grid_interpolate: the lookup in a sparse grid of bricks, values (M, C) rows found through an
// int32 (T0, T1, T2) brick table, at (N, 3) points of a virtual (V0, V1, V2) = shape vertex grid.
at::Tensor brick_grid_interpolate_cpu(const at::Tensor& values, const at::Tensor& table, const at::Tensor& points,
                                      at::IntArrayRef shape, int64_t brick);
std::tuple<at::Tensor, at::Tensor> brick_grid_interpolate_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& values, const at::Tensor& table, const at::Tensor& points,
    at::IntArrayRef shape, int64_t brick, bool values_requires_grad, bool points_requires_grad,
    const std::optional<at::Tensor>& grad_into);

// bilinear upsampling by an integer factor.
at::Tensor upsample_bilinear2d_cpu(const at::Tensor& x, int64_t scale_factor, bool align_corners);
at::Tensor upsample_bilinear2d_backward_cpu(const at::Tensor& grad_out, int64_t input_height, int64_t input_width,
                                            int64_t scale_factor, bool align_corners);

// GELU, exact ("none") or tanh approximation.
at::Tensor gelu_cpu(const at::Tensor& x, c10::string_view approximate);
at::Tensor gelu_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, c10::string_view approximate);
at::Tensor gelu_rows_cpu(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& index,
                         c10::string_view approximate);
std::tuple<at::Tensor, at::Tensor> gelu_rows_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                          const at::Tensor& rows, const at::Tensor& index,
                                                          c10::string_view approximate);

// volume_render: alpha compositing of packed samples, ray b's at [ray_offsets[b], ray_offsets[b + 1]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> volume_render_cpu(const at::Tensor& optical_depth,
                                                                 const at::Tensor& values, const at::Tensor& t,
                                                                 const at::Tensor& ray_offsets, double early_stop);
std::tuple<at::Tensor, at::Tensor> volume_render_backward_cpu(
    const at::Tensor& grad_values, const at::Tensor& grad_opacity, const at::Tensor& grad_depth,
    const at::Tensor& optical_depth, const at::Tensor& values, const at::Tensor& t, const at::Tensor& ray_offsets,
    const at::Tensor& out, const at::Tensor& opacity, const at::Tensor& depth, double early_stop);

// visible_samples: the packed samples a ray still sees (early termination) and those worth a colour (weight
// threshold) -> (index (A,), keep (K,) positions in index, offsets (B + 1,) of the alive samples per ray).
std::tuple<at::Tensor, at::Tensor, at::Tensor> visible_samples_cpu(const at::Tensor& optical_depth,
                                                                   const at::Tensor& ray_offsets,
                                                                   double early_termination, double weight_threshold,
                                                                   const std::optional<at::Tensor>& start_depth);
// visible_samples_capped: the same into outputs of fixed sizes with no host sync (visibility.h) -> (index (Ca,),
// keep (Cs,), offsets (B + 1,) clamped to Ca, totals (2,) int64: A and K).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> visible_samples_capped_cpu(
    const at::Tensor& optical_depth, const at::Tensor& ray_offsets, double early_termination, double weight_threshold,
    int64_t alive_capacity, int64_t shown_capacity, const std::optional<at::Tensor>& start_depth);

// march_rays: packed samples of (B, 3) rays where the (R0, R1, R2) occupancy grid is set -> (ray (N,),
// t (N,), points (N, 3) in grid coordinates, ray_offsets (B + 1,)); t_split given: the contracted space; slab given:
// only samples in those first-axis cells [first, end).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_cpu(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab);
// march_rays_capped: the same samples into outputs of a fixed size (capacity,), with no host sync: the first
// `capacity` of them, the ray offsets clamped to it, the rest padding; plus (1,) int64 the samples' true total.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_capped_cpu(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    int64_t capacity, const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab);

// sparse_adam_step: Adam on the listed rows of a (M, C) parameter, in place; with clear_grad the listed rows of
// the gradient are left zero.
void sparse_adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const at::Tensor& rows, int64_t step, double lr, double beta1,
                          double beta2, double eps, bool clear_grad);
// masked_adam_step: Adam on the elements of a (M, C) parameter whose gradient is non-zero, in place; with
// clear_grad the gradient is left zero (written only where it was not: the next step's lookups add onto it).
void masked_adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2, double eps,
                          bool clear_grad);

// distortion_loss: mip-NeRF 360's distortion loss of each ray of packed samples, from their optical depths and
// (N,) interval ends; its backward gives the optical depths' gradient (distortion.h).
at::Tensor distortion_loss_cpu(const at::Tensor& optical_depth, const at::Tensor& t_start, const at::Tensor& t_end,
                               const at::Tensor& ray_offsets);
at::Tensor distortion_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& optical_depth,
                                        const at::Tensor& t_start, const at::Tensor& t_end,
                                        const at::Tensor& ray_offsets);

// sampled_tv: the total variation on sampled cells of a stack of (R0, R1, R2) vertex grids (rows of values),
// returned (0-d float64) with its gradient added into grad in place.
at::Tensor sampled_tv_cpu(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& cells,
                          at::IntArrayRef shape, at::IntArrayRef inside, double outside, double scale);

#ifdef WITH_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_cuda(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> march_rays_capped_cuda(
    const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start, const at::Tensor& t_end,
    const at::Tensor& offset, const at::Tensor& occupancy, const at::Tensor& box, double step, int64_t max_samples,
    int64_t capacity, const std::optional<at::Tensor>& t_split, at::OptionalIntArrayRef slab);
void sparse_adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq, const at::Tensor& rows, int64_t step, double lr, double beta1,
                           double beta2, double eps, bool clear_grad);
void masked_adam_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                           double eps, bool clear_grad);
std::tuple<at::Tensor, at::Tensor, at::Tensor> volume_render_cuda(const at::Tensor& optical_depth,
                                                                  const at::Tensor& values, const at::Tensor& t,
                                                                  const at::Tensor& ray_offsets, double early_stop);
std::tuple<at::Tensor, at::Tensor> volume_render_backward_cuda(
    const at::Tensor& grad_values, const at::Tensor& grad_opacity, const at::Tensor& grad_depth,
    const at::Tensor& optical_depth, const at::Tensor& values, const at::Tensor& t, const at::Tensor& ray_offsets,
    const at::Tensor& out, const at::Tensor& opacity, const at::Tensor& depth, double early_stop);
std::tuple<at::Tensor, at::Tensor, at::Tensor> visible_samples_cuda(const at::Tensor& optical_depth,
                                                                    const at::Tensor& ray_offsets,
                                                                    double early_termination, double weight_threshold,
                                                                    const std::optional<at::Tensor>& start_depth);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> visible_samples_capped_cuda(
    const at::Tensor& optical_depth, const at::Tensor& ray_offsets, double early_termination, double weight_threshold,
    int64_t alive_capacity, int64_t shown_capacity, const std::optional<at::Tensor>& start_depth);
at::Tensor trilinear_interpolate_cuda(const at::Tensor& feats, const at::Tensor& points);
std::tuple<at::Tensor, at::Tensor> trilinear_interpolate_backward_cuda(const at::Tensor& grad_out,
                                                                       const at::Tensor& feats,
                                                                       const at::Tensor& points,
                                                                       bool feats_requires_grad,
                                                                       bool points_requires_grad);
at::Tensor grid_interpolate_cuda(const at::Tensor& grid, const at::Tensor& points);
std::tuple<at::Tensor, at::Tensor> grid_interpolate_backward_cuda(const at::Tensor& grad_out, const at::Tensor& grid,
                                                                  const at::Tensor& points, bool grid_requires_grad,
                                                                  bool points_requires_grad,
                                                                  const std::optional<at::Tensor>& grad_into);
at::Tensor brick_grid_interpolate_cuda(const at::Tensor& values, const at::Tensor& table, const at::Tensor& points,
                                       at::IntArrayRef shape, int64_t brick);
std::tuple<at::Tensor, at::Tensor> brick_grid_interpolate_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& values, const at::Tensor& table, const at::Tensor& points,
    at::IntArrayRef shape, int64_t brick, bool values_requires_grad, bool points_requires_grad,
    const std::optional<at::Tensor>& grad_into);
at::Tensor upsample_bilinear2d_cuda(const at::Tensor& x, int64_t scale_factor, bool align_corners);
at::Tensor upsample_bilinear2d_backward_cuda(const at::Tensor& grad_out, int64_t input_height, int64_t input_width,
                                             int64_t scale_factor, bool align_corners);
at::Tensor gelu_cuda(const at::Tensor& x, c10::string_view approximate);
at::Tensor gelu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, c10::string_view approximate);
at::Tensor gelu_rows_cuda(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& index,
                          c10::string_view approximate);
std::tuple<at::Tensor, at::Tensor> gelu_rows_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                           const at::Tensor& rows, const at::Tensor& index,
                                                           c10::string_view approximate);
at::Tensor distortion_loss_cuda(const at::Tensor& optical_depth, const at::Tensor& t_start, const at::Tensor& t_end,
                                const at::Tensor& ray_offsets);
at::Tensor distortion_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& optical_depth,
                                         const at::Tensor& t_start, const at::Tensor& t_end,
                                         const at::Tensor& ray_offsets);
at::Tensor sampled_tv_cuda(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& cells,
                           at::IntArrayRef shape, at::IntArrayRef inside, double outside, double scale);
#endif

}  // namespace cuda_ext
