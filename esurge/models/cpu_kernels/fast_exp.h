// exp for the kernels of this directory: softmax and sigmoid arguments are
// made non-positive first, so one vectorisable, overflow-free form serves both.

#ifndef ESURGE_MODELS_CPU_KERNELS_FAST_EXP_H_
#define ESURGE_MODELS_CPU_KERNELS_FAST_EXP_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace esurge_kernels {

// exp for x <= 0 (softmax arguments), vectorisable, ~2 ulp: 2^n * e^f with
// f in [-ln2/2, ln2/2] and a degree-6 polynomial. Below -87 it returns 0.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float f = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * f + 1.3981999507e-3f;
  poly = poly * f + 8.3334519073e-3f;
  poly = poly * f + 4.1665795894e-2f;
  poly = poly * f + 1.6666665459e-1f;
  poly = poly * f + 5.0000001201e-1f;
  poly = poly * f * f + f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &poly, 4);
  bits += static_cast<int32_t>(n) << 23;
  float result;
  std::memcpy(&result, &bits, 4);
  return x < -87.0f ? 0.0f : result;
}

}  // namespace esurge_kernels

#endif  // ESURGE_MODELS_CPU_KERNELS_FAST_EXP_H_
