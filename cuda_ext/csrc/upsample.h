// Bilinear upsampling by an integer factor: argument checks and the per-axis index map, shared by the
// CPU kernels (cpu/upsample.cpp) and the CUDA kernels (cuda/upsample.cu).
//
// Bilinear interpolation is separable, so everything is described one axis at a time by UpsampleAxis:
// - the forward reads, for output o, two taps i0 <= i1 with weights l0 + l1 = 1 (taps());
// - the backward is a gather: input i sums the output gradients of the outputs whose taps touch it,
//   weighted by weight(i, o); those outputs form one contiguous range (window()).
// Both derive from taps(), so forward and backward cannot disagree.
#pragma once

#include <limits>

#include "kernel_common.h"

namespace cuda_ext {

// Outputs [begin, end) of one axis.
struct OutputRange {
  int64_t begin, end;
};

template <typename acc_t>
struct LinearTaps {
  int64_t i0, i1;  // source indices, i1 = i0 + 1 except at the last input (then i1 = i0)
  acc_t l0, l1;    // their weights, l0 = 1 - l1
};

// One axis of F.interpolate(mode="bilinear", scale_factor=s) with an integer s: in_size inputs,
// out_size = in_size * s outputs. acc_t is the precision of the weights (float or double).
template <typename acc_t>
struct UpsampleAxis {
  int64_t in_size;
  int64_t out_size;
  bool align_corners;
  // PyTorch's step between source positions: (in - 1) / (out - 1) with align_corners, else 1 / s
  // (F.interpolate passes the user's scale_factor on, so the step is 1/s, not in/out).
  acc_t ratio;
  // The exact source position of output o is (step_num * o + offset_num) / den; it gives the integer
  // part of the position (i0) exactly, where ratio * o can land a rounding error below an integer.
  int64_t step_num;
  int64_t offset_num;
  int64_t den;
  double inverse_den;  // 1 / den: the position without a division (GPU divisions are slow)
  acc_t inverse_step;  // 1 / step_num (0 when step_num is 0), to invert the map without dividing

  static UpsampleAxis make(int64_t in_size, int64_t scale, bool align_corners) {
    UpsampleAxis a;
    a.in_size = in_size;
    a.out_size = in_size * scale;
    a.align_corners = align_corners;
    if (align_corners) {
      a.ratio = a.out_size > 1 ? static_cast<acc_t>(in_size - 1) / static_cast<acc_t>(a.out_size - 1) : acc_t(0);
      a.step_num = in_size - 1;  // position o * (in - 1) / (out - 1)
      a.offset_num = 0;
      a.den = a.out_size > 1 ? a.out_size - 1 : 1;
    } else {
      a.ratio = static_cast<acc_t>(1.0 / static_cast<double>(scale));
      a.step_num = 2;  // position (o + 0.5) / s - 0.5 = (2 * o + 1 - s) / (2 * s)
      a.offset_num = 1 - scale;
      a.den = 2 * scale;
    }
    a.inverse_den = 1.0 / static_cast<double>(a.den);
    a.inverse_step = a.step_num > 0 ? acc_t(1) / static_cast<acc_t>(a.step_num) : acc_t(0);
    return a;
  }

  // PyTorch's floating-point source position of output o (clamped at 0 without align_corners).
  CUDA_EXT_HOST_DEVICE acc_t source(int64_t o) const {
    if (align_corners) return ratio * static_cast<acc_t>(o);
    const acc_t s = ratio * (static_cast<acc_t>(o) + acc_t(0.5)) - acc_t(0.5);
    return s < acc_t(0) ? acc_t(0) : s;
  }

  // floor of the exact source position of output o, clamped to the inputs. The double estimate is
  // within one of the true floor (|num| < 2^63, quotient < 2^31), and one integer step makes it exact.
  CUDA_EXT_HOST_DEVICE int64_t source_floor(int64_t o) const {
    const int64_t num = step_num * o + offset_num;
    int64_t f = static_cast<int64_t>(floor(static_cast<double>(num) * inverse_den));
    if (f * den > num) {
      --f;
    } else if ((f + 1) * den <= num) {
      ++f;
    }
    return f < 0 ? 0 : (f > in_size - 1 ? in_size - 1 : f);
  }

  CUDA_EXT_HOST_DEVICE LinearTaps<acc_t> taps(int64_t o) const {
    const acc_t src = source(o);
    LinearTaps<acc_t> t;
    t.i0 = source_floor(o);
    t.i1 = t.i0 < in_size - 1 ? t.i0 + 1 : t.i0;
    const acc_t frac = src - static_cast<acc_t>(t.i0);
    t.l1 = frac < acc_t(0) ? acc_t(0) : (frac > acc_t(1) ? acc_t(1) : frac);
    t.l0 = acc_t(1) - t.l1;
    return t;
  }

  // How much input i contributes to output o (0 when neither tap of o is i).
  CUDA_EXT_HOST_DEVICE acc_t weight(int64_t i, int64_t o) const {
    const LinearTaps<acc_t> t = taps(o);
    return (t.i0 == i ? t.l0 : acc_t(0)) + (t.i1 == i ? t.l1 : acc_t(0));
  }

  // An output whose source position is near input position pos (inverse of the map, rounded).
  CUDA_EXT_HOST_DEVICE int64_t output_near(int64_t pos) const {
    if (step_num == 0) return pos <= 0 ? 0 : out_size;  // a single input feeds every output
    // Only an estimate (window() walks to the exact bounds), so floating point and no division.
    const acc_t o = static_cast<acc_t>(pos * den - offset_num) * inverse_step;
    return o < acc_t(0) ? 0 : (o > static_cast<acc_t>(out_size) ? out_size : static_cast<int64_t>(o));
  }

  // The outputs whose taps touch input i: {o : i0(o) <= i <= i1(o)}, one range because i0 and i1
  // never decrease with o. Starts from the inverse map and walks to the exact bounds.
  CUDA_EXT_HOST_DEVICE OutputRange window(int64_t i) const {
    int64_t b = output_near(i - 1);
    while (b > 0 && taps(b - 1).i1 >= i) --b;
    while (b < out_size && taps(b).i1 < i) ++b;
    int64_t e = output_near(i + 1);
    if (e < b) e = b;
    while (e < out_size && taps(e).i0 <= i) ++e;
    while (e > b && taps(e - 1).i0 > i) --e;
    return OutputRange{b, e};
  }

  // Longest window over all inputs (host side: sizes the backward's per-thread weight cache).
  int64_t max_window() const {
    int64_t longest = 0;
    for (int64_t i = 0; i < in_size; ++i) {
      const OutputRange r = window(i);
      longest = r.end - r.begin > longest ? r.end - r.begin : longest;
    }
    return longest;
  }
};

inline void check_scale_factor(int64_t scale_factor, const char* op) {
  TORCH_CHECK(scale_factor >= 1, op, ": scale_factor must be an integer >= 1, got ", scale_factor);
}

// Output size along an axis, refusing sizes whose products would overflow 64-bit indexing.
inline int64_t upsampled_size(int64_t in_size, int64_t scale_factor, const char* op, const char* arg) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();  // keeps step_num * o and f * den far from overflow
  TORCH_CHECK(in_size <= kMax / scale_factor, op, ": ", arg, " times scale_factor must be at most ", kMax, ", got ",
              in_size, " * ", scale_factor);
  return in_size * scale_factor;
}

inline void check_upsample_input(const at::Tensor& x, int64_t scale_factor) {
  constexpr const char* op = "upsample_bilinear2d";
  TORCH_CHECK(x.dim() == 4, op, ": x must be 4-D (B, C, H, W), got ", x.dim(), "-D with shape ", x.sizes());
  check_floating_dtype(x, op, "x");
  check_scale_factor(scale_factor, op);
  upsampled_size(x.size(2), scale_factor, op, "x height");
  upsampled_size(x.size(3), scale_factor, op, "x width");
}

inline void check_upsample_backward_input(const at::Tensor& grad_out, int64_t input_height, int64_t input_width,
                                          int64_t scale_factor) {
  constexpr const char* op = "upsample_bilinear2d_backward";
  check_scale_factor(scale_factor, op);
  TORCH_CHECK(input_height >= 0 && input_width >= 0, op, ": input_height and input_width must be >= 0, got ",
              input_height, " and ", input_width);
  TORCH_CHECK(grad_out.dim() == 4, op, ": grad_out must be 4-D (B, C, H*s, W*s), got ", grad_out.dim(),
              "-D with shape ", grad_out.sizes());
  check_floating_dtype(grad_out, op, "grad_out");
  const int64_t out_h = upsampled_size(input_height, scale_factor, op, "input_height");
  const int64_t out_w = upsampled_size(input_width, scale_factor, op, "input_width");
  TORCH_CHECK(grad_out.size(2) == out_h && grad_out.size(3) == out_w, op, ": grad_out must be (B, C, ", out_h, ", ",
              out_w, ") for input ", input_height, "x", input_width, " and scale_factor ", scale_factor, ", got ",
              grad_out.sizes());
}

}  // namespace cuda_ext
