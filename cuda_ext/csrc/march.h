// march_rays: samples along rays, kept where the occupancy grid says the space is not empty, written packed (ray
// by ray, in order along each ray) without the dense (B, S) sample tensor and mask. Argument checks and the
// per-sample math shared by the CPU kernel (cpu/march.cpp) and the CUDA kernel (cuda/march.cu).
//
// Bounded (no t_split): sample k < max_samples of ray b sits at t_k = t_start_b + (k + offset_b) * step; its
// point is the box coordinate u = (o + t_k d - lo) * (2 / (hi - lo)) - 1 and the occupancy grid spans the box.
// Contracted (t_split given): the first K_b = clamp(ceil((t_split_b - t_start_b) / step - offset_b), 0, max_samples)
// samples are the linear ones above; sample k >= K_b (j = k - K_b) is spaced uniformly in disparity about the
// pivot t_split_b - P (P: the box's smallest half size), continuing the linear step at t_split_b:
//   den = 1 - (j + offset_b) * (step / P),  t_k = (t_split_b - P) + P / den   (only while den > 0: t -> infinity),
// and its point is the contracted coordinate: with m = max_a |u_a|, u * ((2 - 1 / m) / m) where m > 1 (u inside
// the box stays), halved so that the contracted cube [-2, 2]^3 is the grid's [-1, 1]^3.
// Either way a sample is kept when the occupancy cell holding its point is set (cell trunc((p_a + 1) * (0.5 * R_a))
// clamped to [0, R_a - 1]) and, with a slab [first, end) given, its cell along the first axis is in it (a split
// rank's part of the grid: the walk then covers only the samples near it, MarchRay::slab_span); a ray ends at its
// first sample with t >= t_end (or den <= 0). Every operation is
// rounded separately, in the order written (no fused multiply-add; divisions correctly rounded), so the samples are
// bit for bit those of the PyTorch reference (cuda_ext.reference.march_rays), which evaluates the same formulas
// one tensor op at a time.
#pragma once

#include <cmath>

#include "kernel_common.h"

namespace cuda_ext {

// Separately rounded arithmetic: under nvcc the intrinsics stop the compiler from contracting a * b + c into
// an FMA (which would round once and move samples across cell borders) and keep divisions IEEE-rounded; the C++
// build is compiled with -ffp-contract=off.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
#else
template <typename T>
inline T mul_rn(T a, T b) {
  return a * b;
}
template <typename T>
inline T add_rn(T a, T b) {
  return a + b;
}
template <typename T>
inline T div_rn(T a, T b) {
  return a / b;
}
#endif

// max(a, b) that returns NaN when either is NaN (as torch.amax does), |x| and ceil(x) on host and device.
template <typename T>
CUDA_EXT_HOST_DEVICE T nan_max(T a, T b) {
  return (a != a || a > b) ? a : b;
}
template <typename T>
CUDA_EXT_HOST_DEVICE T magnitude(T x) {
  return x < T(0) ? -x : x;
}
template <typename T>
CUDA_EXT_HOST_DEVICE T ceil_of(T x) {
#if defined(__CUDA_ARCH__)
  return ceil(x);
#else
  return std::ceil(x);
#endif
}
template <typename T>
CUDA_EXT_HOST_DEVICE T floor_of(T x) {
#if defined(__CUDA_ARCH__)
  return floor(x);
#else
  return std::floor(x);
#endif
}

// One ray's constants: origin, direction, the box's low corner and 2 / (hi - lo), the grid's half sizes; with the
// contraction, its linear sample count and the disparity spacing's pivot, radius P and step / P.
template <typename T>
struct MarchRay {
  T origin[3], direction[3], low[3], scale[3], half_cells[3];
  T t_start, t_end, offset, step;
  int64_t cells[3];
  bool contract = false;
  int64_t linear_count = 0;
  T pivot = T(0), radius = T(0), ratio = T(0);

  CUDA_EXT_HOST_DEVICE MarchRay(const T* o, const T* d, const T* box, const int64_t* shape, T t0, T t1, T off, T dt)
      : t_start(t0), t_end(t1), offset(off), step(dt) {
    for (int a = 0; a < 3; ++a) {
      origin[a] = o[a];
      direction[a] = d[a];
      low[a] = box[a];
      scale[a] = T(2) / add_rn(box[3 + a], -box[a]);
      cells[a] = shape[a];
      half_cells[a] = T(0.5 * static_cast<double>(shape[a]));
    }
  }

  // Switch to the contracted space: linear samples up to t_split, then disparity spacing (see the top).
  CUDA_EXT_HOST_DEVICE void contract_at(T t_split, const T* box, int64_t max_samples) {
    contract = true;
    radius = mul_rn(add_rn(box[3], -box[0]), T(0.5));
    for (int a = 1; a < 3; ++a) {
      const T half = mul_rn(add_rn(box[3 + a], -box[a]), T(0.5));
      radius = half < radius ? half : radius;
    }
    ratio = div_rn(step, radius);
    pivot = add_rn(t_split, -radius);
    T count = ceil_of(add_rn(div_rn(add_rn(t_split, -t_start), step), -offset));
    const T cap = static_cast<T>(max_samples);
    count = count > T(0) ? (count < cap ? count : cap) : T(0);  // NaN -> 0, as in the reference
    linear_count = static_cast<int64_t>(count);
  }

  // Distance of sample k; false when the ray has ended there (t >= t_end, or past infinity).
  CUDA_EXT_HOST_DEVICE bool sample(int64_t k, T* t) const {
    if (!contract || k < linear_count) {
      *t = add_rn(t_start, mul_rn(add_rn(T(k), offset), step));
      return *t < t_end;
    }
    const T den = add_rn(T(1), -mul_rn(add_rn(T(k - linear_count), offset), ratio));
    *t = add_rn(pivot, div_rn(radius, den));
    return den > T(0) && *t < t_end;
  }

  // The samples [*first, *end) that can lie in the first-axis cells [cell_first, cell_end) (a rank's slab), from
  // where the ray's line crosses the slab's planes, widened far beyond rounding (2^-16 of the distances involved,
  // and 2 samples): a walk over them meets every sample a slab keeps, and each sample's own cell still decides. A
  // first or last slab runs on past the grid (its cells take the clamped points). Contracted rays, rays along the
  // planes and non-finite ones walk all their samples. Computed in double.
  CUDA_EXT_HOST_DEVICE void slab_span(int64_t cell_first, int64_t cell_end, int64_t max_samples, int64_t* first,
                                      int64_t* end) const {
    *first = 0;
    *end = max_samples;
    if (contract) return;
    const double per_unit = static_cast<double>(scale[0]) * static_cast<double>(half_cells[0]);
    const double rate = static_cast<double>(direction[0]) * per_unit;  // cells per unit of t
    const double at_zero = (static_cast<double>(origin[0]) - static_cast<double>(low[0])) * per_unit;  // cell at t 0
    const double t0 = static_cast<double>(t_start), dt = static_cast<double>(step), off = static_cast<double>(offset);
    const double reach = magnitude(at_zero / rate) + static_cast<double>(cells[0]) / magnitude(rate);  // |t| in grid
    const double slack = (magnitude(t0) + reach) * (1.0 / 65536.0);
    if (!(reach - reach == 0.0) || !(slack + t0 + dt + off - (slack + t0 + dt + off) == 0.0)) return;  // not finite
    const double lower = cell_first > 0 ? static_cast<double>(cell_first) : -HUGE_VAL;
    const double upper = cell_end < cells[0] ? static_cast<double>(cell_end) : HUGE_VAL;
    double enter = (lower - at_zero) / rate, leave = (upper - at_zero) / rate;
    if (rate < 0.0) {
      const double swap = enter;
      enter = leave;
      leave = swap;
    }
    const double k_first = floor_of((enter - slack - t0) / dt - off) - 2.0;
    const double k_end = ceil_of((leave + slack - t0) / dt - off) + 3.0;
    const double cap = static_cast<double>(max_samples);
    *first = k_first > 0.0 ? (k_first < cap ? static_cast<int64_t>(k_first) : max_samples) : 0;
    *end = k_end > 0.0 ? (k_end < cap ? static_cast<int64_t>(k_end) : max_samples) : 0;
  }

  // Grid coordinates of the point at distance t (box or contracted), and the flat index of its occupancy cell
  // (its cell along the first axis in *first_axis, when given).
  CUDA_EXT_HOST_DEVICE int64_t locate(T t, T* unit, int64_t* first_axis = nullptr) const {
    for (int a = 0; a < 3; ++a) {
      const T world = add_rn(origin[a], mul_rn(t, direction[a]));
      unit[a] = add_rn(mul_rn(add_rn(world, -low[a]), scale[a]), T(-1));
    }
    if (contract) {
      const T norm = nan_max(nan_max(magnitude(unit[0]), magnitude(unit[1])), magnitude(unit[2]));
      const T shrink = norm > T(1) ? div_rn(add_rn(T(2), -div_rn(T(1), norm)), norm) : T(1);
      for (int a = 0; a < 3; ++a) unit[a] = mul_rn(mul_rn(unit[a], shrink), T(0.5));
    }
    int64_t index = 0;
    for (int a = 0; a < 3; ++a) {
      T cell = mul_rn(add_rn(unit[a], T(1)), half_cells[a]);
      const T last = static_cast<T>(cells[a] - 1);
      cell = cell > T(0) ? (cell < last ? cell : last) : T(0);  // NaN -> 0, as clamp(long(NaN)) in the reference
      index = index * cells[a] + static_cast<int64_t>(cell);
      if (a == 0 && first_axis != nullptr) *first_axis = static_cast<int64_t>(cell);
    }
    return index;
  }
};

inline void check_march_inputs(const at::Tensor& origins, const at::Tensor& directions, const at::Tensor& t_start,
                               const at::Tensor& t_end, const at::Tensor& offset, const at::Tensor& occupancy,
                               const at::Tensor& box, double step, int64_t max_samples,
                               const std::optional<at::Tensor>& t_split, at::DeviceType device) {
  const char* op = "march_rays";
  TORCH_CHECK(origins.dim() == 2 && origins.size(1) == 3, op, ": origins must have shape (B, 3), got ",
              origins.sizes());
  const int64_t rays = origins.size(0);
  check_device_type(origins, "origins", device, op);
  TORCH_CHECK(origins.scalar_type() == at::kFloat || origins.scalar_type() == at::kDouble, op,
              ": origins must be float32 or float64, got ", origins.scalar_type());
  TORCH_CHECK(directions.sizes() == origins.sizes(), op, ": directions must have shape (", rays, ", 3), got ",
              directions.sizes());
  check_same_device_and_dtype(directions, origins, op, "directions", "origins");
  const std::pair<const at::Tensor*, const char*> per_ray[] = {
      {&t_start, "t_start"}, {&t_end, "t_end"}, {&offset, "offset"}, {t_split ? &*t_split : nullptr, "t_split"}};
  for (const auto& [tensor, name] : per_ray) {
    if (tensor == nullptr) continue;
    TORCH_CHECK(tensor->dim() == 1 && tensor->size(0) == rays, op, ": ", name, " must have shape (", rays, ",), got ",
                tensor->sizes());
    check_same_device_and_dtype(*tensor, origins, op, name, "origins");
  }
  TORCH_CHECK(box.dim() == 2 && box.size(0) == 2 && box.size(1) == 3, op, ": box must have shape (2, 3), got ",
              box.sizes());
  check_same_device_and_dtype(box, origins, op, "box", "origins");
  TORCH_CHECK(occupancy.dim() == 3 && occupancy.numel() > 0, op,
              ": occupancy must have shape (R0, R1, R2) with every R >= 1, got ", occupancy.sizes());
  TORCH_CHECK(occupancy.scalar_type() == at::kBool, op, ": occupancy must be bool, got ", occupancy.scalar_type());
  TORCH_CHECK(occupancy.device() == origins.device(), op, ": occupancy and origins must be on the same device, got ",
              occupancy.device(), " and ", origins.device());
  TORCH_CHECK(step > 0.0 && step < std::numeric_limits<double>::infinity(), op,
              ": step must be a finite number > 0, got ", step);
  TORCH_CHECK(max_samples >= 1 && max_samples <= (int64_t{1} << 24), op, ": max_samples must be in [1, 2^24], got ",
              max_samples);
}

// The optional slab: [first, end) cells of the occupancy's first axis, 0 <= first < end <= R0.
inline void check_march_slab(const at::OptionalIntArrayRef& slab, const at::Tensor& occupancy) {
  if (!slab) return;
  TORCH_CHECK(slab->size() == 2, "march_rays: slab must be [first, end], got ", slab->size(), " values");
  TORCH_CHECK(0 <= (*slab)[0] && (*slab)[0] < (*slab)[1] && (*slab)[1] <= occupancy.size(0),
              "march_rays: slab must be cells [first, end) with 0 <= first < end <= ", occupancy.size(0), ", got [",
              (*slab)[0], ", ", (*slab)[1], ")");
}

// march_rays_capped's capacity: a size (>= 0) the outputs are allocated at, whatever the samples' count.
inline void check_march_capacity(int64_t capacity) {
  TORCH_CHECK(capacity >= 0, "march_rays_capped: capacity must be >= 0, got ", capacity);
}

// The ray index a padding slot of march_rays_capped holds: the last ray's (the indices stay non-decreasing and
// valid for a gather), 0 without rays. Its t and point are 0 (the box centre: a valid lookup).
inline int64_t march_padding_ray(int64_t rays) { return rays > 0 ? rays - 1 : 0; }

// The (size,) ray, (size,) t and (size, 3) points outputs: padding where `padded` (march_rays_capped: the slots past
// the samples keep it), left unwritten otherwise (march_rays writes every slot).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> march_outputs(int64_t size, int64_t rays, bool padded,
                                                                    const at::TensorOptions& options) {
  const auto index_options = options.dtype(at::kLong);
  if (!padded) {
    return {at::empty({size}, index_options), at::empty({size}, options), at::empty({size, 3}, options)};
  }
  return {at::full({size}, march_padding_ray(rays), index_options), at::zeros({size}, options),
          at::zeros({size, 3}, options)};
}

}  // namespace cuda_ext
