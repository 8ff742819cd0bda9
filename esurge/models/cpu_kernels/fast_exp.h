// exp for the kernels of this directory: softmax and sigmoid arguments are
// made non-positive first, so one vectorisable, overflow-free form serves both.

#ifndef ESURGE_MODELS_CPU_KERNELS_FAST_EXP_H_
#define ESURGE_MODELS_CPU_KERNELS_FAST_EXP_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace esurge_kernels {

// e^f * 2^n from the rounded exponent n and the clamped argument x: f in
// [-ln2/2, ln2/2] (a tie-rounded n pushes it just past) and a degree-6
// polynomial. Shared by the scalar and vector forms below (T: float or a GCC
// float vector).
template <typename T>
inline T ExpMantissa(T x, T n) {
  const T f = x - n * 0.693359375f + n * 2.12194440e-4f;
  T poly = f * 1.9875691500e-4f + 1.3981999507e-3f;
  poly = poly * f + 8.3334519073e-3f;
  poly = poly * f + 4.1665795894e-2f;
  poly = poly * f + 1.6666665459e-1f;
  poly = poly * f + 5.0000001201e-1f;
  return poly * f * f + f + 1.0f;
}

// exp for x <= 0 (softmax arguments), vectorisable, ~2 ulp: 2^n * e^f. Below
// -87 it returns 0.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float poly = ExpMantissa(clamped, n);
  int32_t bits;
  std::memcpy(&bits, &poly, 4);
  bits += static_cast<int32_t>(n) << 23;
  float result;
  std::memcpy(&result, &bits, 4);
  return x < -87.0f ? 0.0f : result;
}

// ExpNonPositive on a whole GCC float vector (GCC vectorises the scalar form
// only to its preferred 256-bit width). n is rounded to nearest through the
// 1.5 * 2^23 shift instead of nearbyint; in a tie it may differ by one, which
// the polynomial absorbs.
template <typename V>
inline V ExpNonPositiveVec(V x) {
  typedef int32_t Bits __attribute__((vector_size(sizeof(V))));
  const V zero = {};
  const V clamped = x < -87.0f ? zero - 87.0f : x;
  const V shift = zero + 12582912.0f;
  const V n = (clamped * 1.44269504088896341f + shift) - shift;
  const V poly = ExpMantissa(clamped, n);
  Bits bits;
  std::memcpy(&bits, &poly, sizeof(bits));
  bits += __builtin_convertvector(n, Bits) << 23;
  V result;
  std::memcpy(&result, &bits, sizeof(result));
  return x < -87.0f ? zero : result;
}

}  // namespace esurge_kernels

#endif  // ESURGE_MODELS_CPU_KERNELS_FAST_EXP_H_
