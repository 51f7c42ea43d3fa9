// FastFloat: a float whose exp, erf and tanh are branch-free inline arithmetic instead of libm calls,
// so a loop over it vectorises (-O3 and `omp simd`). GeluMath (../gelu.h) is written over its
// accumulation type, so GeluMath<FastFloat, .> is the CPU's float GELU with the same formulas.
//
// Accuracy: exp within a few ulp on [-87, 88], 0 below (e^-87 is ~1.6e-38) and infinity above; erf
// within 1.5e-7 absolute (Abramowitz & Stegun 7.1.26, the formula of ATen's vectorised float erf too);
// tanh within ~1e-7 absolute. NaN propagates through all three.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace cuda_ext {

struct FastFloat {
  float v;
  FastFloat() = default;
  constexpr explicit FastFloat(double x) : v(static_cast<float>(x)) {}  // one constructor: acc_t(1) is not ambiguous
};

inline FastFloat operator+(FastFloat a, FastFloat b) { return FastFloat(a.v + b.v); }
inline FastFloat operator-(FastFloat a, FastFloat b) { return FastFloat(a.v - b.v); }
inline FastFloat operator*(FastFloat a, FastFloat b) { return FastFloat(a.v * b.v); }
inline FastFloat operator-(FastFloat a) { return FastFloat(-a.v); }

namespace fast_float_detail {

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float exp(float e) {
  float x = e < -87.f ? -87.f : e;  // clamp for the arithmetic below; comparisons with NaN are false
  x = x > 88.f ? 88.f : x;
  // x = k ln2 + r, |r| <= ln2 / 2. Adding 1.5 * 2^23 rounds x / ln2 to an integer held in the low
  // mantissa bits, which gives k both as a float and (subtracting the bits back) as an integer.
  constexpr float kRoundingShift = 12582912.f;
  const float shifted = x * 1.44269504f + kRoundingShift;
  const float k = shifted - kRoundingShift;
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-6f;  // ln2 split in two: exact k * hi
  // e^r by its Taylor series to r^7 (truncation below 1e-8 relative on |r| <= 0.347), in Horner form.
  float p = 1.f / 5040;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  // 2^k from its exponent bits; k is in [-126, 127] after the clamp (unsigned: no overflow UB for NaN).
  const uint32_t k_int = bits_of(shifted) - bits_of(kRoundingShift);
  const float value = p * float_of((k_int + 127u) << 23);
  // Past the clamp: 0 and infinity as libm gives them (0 keeps x * e^{-x^2/2} at 0 for huge |x|).
  return e < -87.f ? 0.f : (e > 88.f ? HUGE_VALF : value);
}

inline float erf(float x) {
  const float a = std::fabs(x);
  const float t = 1.f / (1.f + 0.3275911f * a);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  return std::copysign(1.f - poly * t * exp(-a * a), x);
}

inline float tanh(float x) {
  // 1 - 2 / (e^{2|x|} + 1): no overflow (e^{2|x|} saturates at e^88) and no NaN for large |x|.
  const float a = std::fabs(x);
  return std::copysign(1.f - 2.f / (exp(2.f * a) + 1.f), x);
}

}  // namespace fast_float_detail

// Found by argument-dependent lookup from GeluMath's calls.
inline FastFloat erf_of(FastFloat x) { return FastFloat(fast_float_detail::erf(x.v)); }
inline FastFloat exp_of(FastFloat x) { return FastFloat(fast_float_detail::exp(x.v)); }
inline FastFloat tanh_of(FastFloat x) { return FastFloat(fast_float_detail::tanh(x.v)); }

}  // namespace cuda_ext
