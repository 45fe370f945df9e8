// exp_nonpositive(x): exp(x) for x <= 0 (a softmax's x - max) in plain float arithmetic, so
// that a loop of it vectorizes (libm's expf, a call an element, was a third of the decode
// kernel's time). Cephes' expf: 2^n * p(r) with n = round(x / ln 2), r = x - n ln 2
// (Cody-Waite); within 2 ulp; below -87, exp(-87) ~ 1.6e-38. Shared by cpu_decode.cpp and
// cpu_sample.cpp (the build key of a kernel hashes this file too: cpu_build.py).
#pragma once
#include <cstdint>

inline float exp_nonpositive(float x) {
  const float c = x < -87.f ? -87.f : x;
  const float n = static_cast<float>(static_cast<int32_t>(c * 1.44269504f - 0.5f));  // c <= 0
  const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n >= -126: a normal float
  return p * __builtin_bit_cast(float, bits);
}
