// x in 24-bit fixed point, as the int8 and int4 GEMMs multiply it (cpu_int8.cpp, cpu_int4.cpp):
// per block of inputs, X = round(x * scale) with the block's own power-of-two scale (1 / step),
// |X| <= X_MAX, written as three signed bytes X = c0 + 2^8 c1 + 2^16 c2 that an unsigned-by-
// signed byte dot product (vpdpbusd) multiplies exactly. Against float32 arithmetic x is rounded
// to 23 bits below its block's largest |x| (at most 2^-23 max |x_block| / 0.996 an element,
// 2^-124 at the least); each kernel's header says what it does with the digits. Shared by both
// (the build key of a kernel hashes this file too: cpu_build.py).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fixed_point {

constexpr int32_t X_MAX = 127 * (1 + 256 + 65536);  // the largest |X| of three signed bytes
constexpr int MIN_EXPONENT = -100;                  // blocks below 2^-100 share 2^-124's step
constexpr uint32_t NONFINITE_BITS = 0x7f800000u;    // an inf's or a NaN's |x| bits, or more

// The bits of the largest |x| of x[0, n), which order as |x| does (a loop of integer maxima
// that GCC vectorizes; a float one it did not: a quarter of int8's 1-row call at K = 256), at
// least NONFINITE_BITS where one is an inf or a NaN. `widen` turns a T into its float.
template <typename T, typename Widen>
inline uint32_t largest_magnitude_bits(const T* x, int64_t n, Widen widen) {
  uint32_t top = 0;
  for (int64_t k = 0; k < n; ++k)
    top = std::max(top, __builtin_bit_cast(uint32_t, widen(x[k])) & 0x7fffffffu);
  return top;
}

// The scale of a block whose largest |x| is `amax` (finite): the power of two that puts amax
// * scale in [2^22, 2^23), one bit lower where that would round above X_MAX (f > 0.996).
inline float block_scale(float amax) {
  int exponent;  // amax = f 2^exponent, f in [0.5, 1)
  std::frexp(amax, &exponent);
  exponent = std::max(exponent, MIN_EXPONENT);
  const float scale = std::ldexp(1.f, 23 - exponent);
  return std::nearbyint(amax * scale) > X_MAX ? 0.5f * scale : scale;
}

// x * scale is exact (a power of two) and within 2^23: the integer nearest to it, ties even.
inline int32_t to_fixed(float x, float scale) {
  return static_cast<int32_t>(std::nearbyint(x * scale));
}

// X -> its digits c0, c1, c2 in [-128, 127]: X = c0 + 2^8 c1 + 2^16 c2, each step exact.
inline void split(int32_t X, int8_t& c0, int8_t& c1, int8_t& c2) {
  c0 = static_cast<int8_t>(X & 0xFF);
  const int32_t high = (X - c0) >> 8;  // a multiple of 256 shifted
  c1 = static_cast<int8_t>(high & 0xFF);
  c2 = static_cast<int8_t>((high - c1) >> 8);
}

}  // namespace fixed_point
