// visible_samples: which packed samples a ray still sees, in one pass per ray (the training march's no-grad
// pass: early ray termination and the weight threshold). Argument checks and the per-sample rule shared by the
// CPU kernel (cpu/visibility.cpp) and the CUDA kernel (cuda/visibility.cu).
//
// For the samples i of ray b, [ray_offsets[b], ray_offsets[b + 1]), in order along the ray:
//   S_i = start_b + sum_{j<i} min(s_j, OPAQUE)   (summed in float64, then rounded to the input's type; start_b:
//   the optional start_depth (B,), the optical depth in front of the ray's first sample, else 0),
//   alive_i = S_i < -log(early_termination)   (every sample when early_termination = 0),
//   w_i = exp(-S_i) * -expm1(-s_i),   shown_i = alive_i and w_i > weight_threshold.
// S only grows along a ray, so its alive samples are a prefix of it. The outputs list them compactly:
//   index (A,) int64: the alive samples, in order; offsets (B + 1,): ray b's are index[offsets[b], offsets[b+1]);
//   keep (K,) int64: the positions in index of the shown samples, in order.
// Both kernels count per ray, scan the counts, then write each ray's entries at its offsets: two passes over the
// optical depths, one device sync (A and K size the outputs).
// visible_samples_capped writes into outputs of fixed sizes instead, with no sync: index (Ca,) with the offsets
// clamped to Ca (a ray past it cut short, the rays after it empty), keep (Cs,) of the shown samples whose position
// is below Ca (a prefix of keep: positions only grow along it), and (2,) int64 totals A, K on the device. Padding:
// index N - 1 (0 when N is 0: a valid row, and index stays sorted), keep Ca (the consumer's spare row: the shading
// pass scatters colours by position, and a padding entry must not land on a real sample).
#pragma once

#include <cmath>
#include <optional>

#include "kernel_common.h"

namespace cuda_ext {

// An optical depth past which no light is left: the prefix sums clamp each term to it (cuda_ext.reference's
// OPAQUE_DEPTH), so a contracted march's last sample (s ~ 1e11) cannot swamp the float64 sums.
constexpr double kOpaqueDepth = 100.0;

// The largest prefix optical depth a sample may have and stay alive: -log(early_termination), or +inf when off,
// rounded to scalar_t as the reference's comparison is.
template <typename scalar_t>
inline scalar_t alive_limit(double early_termination) {
  return early_termination > 0.0 ? static_cast<scalar_t>(-std::log(early_termination))
                                 : std::numeric_limits<scalar_t>::infinity();
}

inline void check_visibility_inputs(const at::Tensor& optical_depth, const at::Tensor& ray_offsets,
                                    double early_termination, double weight_threshold,
                                    const std::optional<at::Tensor>& start_depth, at::DeviceType device) {
  const char* op = "visible_samples";
  TORCH_CHECK(optical_depth.dim() == 1, op, ": optical_depth must have shape (N,), got ", optical_depth.sizes());
  TORCH_CHECK(optical_depth.scalar_type() == at::kFloat || optical_depth.scalar_type() == at::kDouble, op,
              ": optical_depth must be float32 or float64, got ", optical_depth.scalar_type());
  check_device_type(optical_depth, "optical_depth", device, op);
  TORCH_CHECK(ray_offsets.dim() == 1 && ray_offsets.size(0) >= 1, op, ": ray_offsets must have shape (B + 1,), got ",
              ray_offsets.sizes());
  TORCH_CHECK(ray_offsets.scalar_type() == at::kLong, op, ": ray_offsets must be int64, got ",
              ray_offsets.scalar_type());
  TORCH_CHECK(ray_offsets.device() == optical_depth.device(), op,
              ": ray_offsets must be on the same device as optical_depth (", optical_depth.device(), "), got ",
              ray_offsets.device());
  TORCH_CHECK(early_termination >= 0.0 && early_termination < 1.0, op, ": early_termination must be in [0, 1), got ",
              early_termination);
  TORCH_CHECK(weight_threshold >= 0.0 && weight_threshold < 1.0, op, ": weight_threshold must be in [0, 1), got ",
              weight_threshold);
  if (!start_depth) return;
  TORCH_CHECK(start_depth->dim() == 1 && start_depth->size(0) == ray_offsets.size(0) - 1, op,
              ": start_depth must have shape (B,) = (", ray_offsets.size(0) - 1, ",), got ", start_depth->sizes());
  TORCH_CHECK(start_depth->scalar_type() == optical_depth.scalar_type(), op,
              ": start_depth must have optical_depth's dtype (", optical_depth.scalar_type(), "), got ",
              start_depth->scalar_type());
  TORCH_CHECK(start_depth->device() == optical_depth.device(), op,
              ": start_depth must be on the same device as optical_depth (", optical_depth.device(), "), got ",
              start_depth->device());
}

// visible_samples_capped's output sizes.
struct VisibleCapacity {
  int64_t alive, shown;
};

inline void check_visible_capacity(const VisibleCapacity& capacity) {
  TORCH_CHECK(capacity.alive >= 0, "visible_samples_capped: alive_capacity must be >= 0, got ", capacity.alive);
  TORCH_CHECK(capacity.shown >= 0, "visible_samples_capped: shown_capacity must be >= 0, got ", capacity.shown);
}

// The (size,) index and keep outputs: padded (visible_samples_capped, see the top of this file) or left for the
// write pass to fill (visible_samples writes every slot).
inline std::pair<at::Tensor, at::Tensor> visible_outputs(int64_t alive_size, int64_t shown_size, int64_t samples,
                                                         bool padded, const at::TensorOptions& options) {
  if (!padded) return {at::empty({alive_size}, options), at::empty({shown_size}, options)};
  return {at::full({alive_size}, samples > 0 ? samples - 1 : 0, options), at::full({shown_size}, alive_size, options)};
}

}  // namespace cuda_ext
