// Writing bfloat16 kernels' results (bf16_matmul.cc, coded_bf16_matmul.cc):
// a panel row's 32 float32 sums, rounded to bfloat16 once (to nearest even)
// or kept in float32 (a row-parallel shard's partial sum), with the fused
// SiLU gate applied where the panel holds 16 gate then 16 up columns.
// Built only where the compiler targets AVX512_BF16.

#ifndef ESURGE_MODELS_CPU_KERNELS_BF16_STORE_H_
#define ESURGE_MODELS_CPU_KERNELS_BF16_STORE_H_

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fast_exp.h"

namespace esurge_kernels {
namespace bf16 {

constexpr int kPanel = 32;  // output columns per panel (packed_linear.PANEL)
constexpr int kHalf = 16;   // a result vector's columns: half a panel

// Where a kernel's results go: y (bfloat16) or y32 (float32), [M, n].
struct Output {
  uint16_t* y;
  float* y32;
  int64_t n;
  bool silu_mul;
};

// 16 float32 results rounded to bfloat16 (to nearest even), then stored.
inline void StoreBf16(const float* in, uint16_t* out, int64_t width) {
  const __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(in));
  if (width == kHalf) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)packed);
    return;
  }
  uint16_t lanes[kHalf];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), (__m256i)packed);
  std::memcpy(out, lanes, sizeof(uint16_t) * width);
}

// Up to 16 results at y[at:], in the output's dtype.
inline void StoreAt(const Output& out, int64_t at, const float* in, int64_t width) {
  if (out.y32 != nullptr) {
    std::memcpy(out.y32 + at, in, sizeof(float) * width);
  } else {
    StoreBf16(in, out.y + at, width);
  }
}

// One row of panel p's results (gate then up halves with silu_mul) into y.
inline void StoreRow(const Output& out, int64_t row, int64_t p, const float* first,
                     const float* second) {
  if (out.silu_mul) {
    const int64_t col = p * kHalf;
    float act[kHalf];
    for (int j = 0; j < kHalf; ++j) {
      const float g = first[j];
      const float e = ExpNonPositive(-std::fabs(g));
      const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
      act[j] = g * sigmoid * second[j];
    }
    StoreAt(out, row * out.n + col, act, std::min<int64_t>(kHalf, out.n - col));
    return;
  }
  const int64_t col = p * kPanel, at = row * out.n + col;
  StoreAt(out, at, first, std::clamp<int64_t>(out.n - col, 0, kHalf));
  if (out.n - col > kHalf) {
    StoreAt(out, at + kHalf, second, std::min<int64_t>(kHalf, out.n - col - kHalf));
  }
}

}  // namespace bf16
}  // namespace esurge_kernels

#endif  // __AVX512BF16__

#endif  // ESURGE_MODELS_CPU_KERNELS_BF16_STORE_H_
