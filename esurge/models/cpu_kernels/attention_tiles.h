// The arithmetic of the CPU paged-attention kernel: one key block folded into
// a tile of query lanes (a lane is one (row, query head) pair) with an online
// softmax. Included by paged_attention.cc only; see that file for the contract.

#ifndef ESURGE_MODELS_CPU_KERNELS_ATTENTION_TILES_H_
#define ESURGE_MODELS_CPU_KERNELS_ATTENTION_TILES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_exp.h"

namespace esurge_attention {

struct Problem {
  const float* q;             // [T, H, D]
  const float* k;             // [NP, PS, KV, D]
  const float* v;             // [NP, PS, KV, D]
  const float* cos;           // [T, D] RoPE tables, or nullptr: no rotation
  const float* sin;           // [T, D]
  const int32_t* positions;   // [T]
  const int32_t* token_req;   // [T]
  const int32_t* tables;      // [R, P]
  float* out;                 // [T, H, D]
  int64_t num_tokens, heads, kv_heads, dim, page_size, max_pages, num_pages;
  int64_t window, chunk;
  float scale, softcap;
};

// x rotated by row t's RoPE tables into out (D values), as apply_rope in
// esurge/models/rope.py: x * cos + rotate_half(x) * sin, rotate_half(x) being
// (-x[D/2:], x[:D/2]).
inline void Rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t e = 0; e < half; ++e) out[e] = x[e] * cos[e] - x[e + half] * sin[e];
  for (int64_t e = half; e < d; ++e) out[e] = x[e] * cos[e] + x[e - half] * sin[e];
}

constexpr int kQueryBlock = 16;  // rows of one request sharing each loaded key block
constexpr int kKeyBlock = 16;    // keys per block: one 512-bit vector of scores
constexpr int kMaxLaneTile = 8;  // lanes sharing each loaded key vector (see AttendLanes)

// Sixteen scores as one GCC/Clang vector: the compiler maps it onto whatever
// SIMD width -march=native offers, and the key block loop cannot be
// vectorised the wrong way round (across head_dim, with strided loads).
typedef float Scores __attribute__((vector_size(kKeyBlock * sizeof(float))));

using esurge_kernels::ExpNonPositive;

inline float Dot(const float* a, const float* b, int64_t n) {
  // Sixteen independent partial sums let the compiler vectorise without
  // reassociating a single accumulator (no -ffast-math needed).
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s + tail;
}

// Scores s of one lane over one key block -> probabilities in place, folding
// the block into the lane's running max m and denominator l; returns the factor
// the lane's accumulated values must be rescaled by.
// Inlined into each lane tile so the compiler can overlap the lanes' softmax
// chains (measured: 1.5% of a prefill step, 3% of a decode step).
inline __attribute__((always_inline)) float SoftmaxBlock(
    const Problem& p, float* s, int64_t kb, int64_t nk, int64_t first, int64_t last, float& m,
    float& l) {
  for (int j = 0; j < kKeyBlock; ++j) s[j] *= p.scale;
  if (p.softcap > 0.f) {
    for (int j = 0; j < kKeyBlock; ++j) s[j] = std::tanh(s[j] / p.softcap) * p.softcap;
  }
  // Only blocks on a mask edge (causal diagonal, window start, the tail) need
  // per-key masking.
  if (nk < kKeyBlock || kb < first || kb + kKeyBlock - 1 > last) {
    for (int j = 0; j < kKeyBlock; ++j) {
      const int64_t kp = kb + j;
      if (j >= nk || kp < first || kp > last) s[j] = -INFINITY;
    }
  }
  float block_max = s[0];
  for (int j = 1; j < kKeyBlock; ++j) block_max = std::max(block_max, s[j]);
  const float m_new = std::max(m, block_max);
  const float alpha = m == -INFINITY ? 0.f : ExpNonPositive(m - m_new);
  for (int j = 0; j < kKeyBlock; ++j) s[j] = ExpNonPositive(s[j] - m_new);
  float sum = 0.f;
  for (int j = 0; j < kKeyBlock; ++j) sum += s[j];
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

struct Scratch {
  std::vector<float> kt;   // [D, kKeyBlock] the key block, transposed
  std::vector<float> acc;  // [rows * group, D]
  std::vector<float> m, l; // [rows * group] running max and denominator
  std::vector<float> qs;   // [rows * group, D] scaled queries
};

// One loaded key block: its first position, key count and slot pointers.
struct KeyBlock {
  int64_t kb = 0, nk = 0;
  const float* keys[kKeyBlock];
  const float* values[kKeyBlock];
};

// Folds one key block into lanes [0, lanes) (a lane is a (row, query head)
// pair; lanes past `lanes` are padding), Tile lanes at a time so each loaded
// key vector and value chunk feeds Tile accumulators.
template <int Tile>
void AttendLanes(const Problem& p, Scratch& w, const KeyBlock& blk, const int64_t* first,
                 const int64_t* last, int64_t rows, int64_t group, int64_t lanes,
                 bool transpose) {
  const int64_t d = p.dim;
  for (int64_t l0 = 0; l0 < lanes; l0 += Tile) {
    float s[Tile][kKeyBlock];
    float alpha[Tile];
    bool live[Tile];
    bool any = false;
    for (int u = 0; u < Tile; ++u) {
      const int64_t i = (l0 + u) / group;
      live[u] = i < rows && last[i] >= blk.kb && first[i] <= blk.kb + blk.nk - 1;
      any = any || live[u];
    }
    if (!any) continue;  // nothing visible to these lanes here
    if (transpose) {
      Scores sv[Tile] = {};
      for (int64_t e = 0; e < d; ++e) {
        Scores kv;
        std::memcpy(&kv, w.kt.data() + e * kKeyBlock, sizeof(Scores));
        for (int u = 0; u < Tile; ++u) sv[u] += w.qs[(l0 + u) * d + e] * kv;
      }
      for (int u = 0; u < Tile; ++u) std::memcpy(s[u], &sv[u], sizeof(Scores));
    } else {
      for (int u = 0; u < Tile; ++u) {
        for (int j = 0; j < kKeyBlock; ++j) {
          const bool used = live[u] && j < blk.nk;
          s[u][j] = used ? Dot(w.qs.data() + (l0 + u) * d, blk.keys[j], d) : 0.f;
        }
      }
    }
    for (int u = 0; u < Tile; ++u) {
      alpha[u] = 1.f;
      if (!live[u]) {
        for (int j = 0; j < kKeyBlock; ++j) s[u][j] = 0.f;
        continue;
      }
      const int64_t lane = l0 + u, i = lane / group;
      alpha[u] = SoftmaxBlock(p, s[u], blk.kb, blk.nk, first[i], last[i], w.m[lane], w.l[lane]);
    }
    int64_t e0 = 0;
    for (; e0 + kKeyBlock <= d; e0 += kKeyBlock) {
      Scores acc[Tile];
      for (int u = 0; u < Tile; ++u) {
        std::memcpy(&acc[u], w.acc.data() + (l0 + u) * d + e0, sizeof(Scores));
        acc[u] *= alpha[u];
      }
      for (int64_t j = 0; j < blk.nk; ++j) {
        Scores v;
        std::memcpy(&v, blk.values[j] + e0, sizeof(Scores));
        for (int u = 0; u < Tile; ++u) acc[u] += s[u][j] * v;
      }
      for (int u = 0; u < Tile; ++u) {
        std::memcpy(w.acc.data() + (l0 + u) * d + e0, &acc[u], sizeof(Scores));
      }
    }
    for (int u = 0; u < Tile && e0 < d; ++u) {
      float* acc = w.acc.data() + (l0 + u) * d;
      for (int64_t e = e0; e < d; ++e) {
        acc[e] *= alpha[u];
        for (int64_t j = 0; j < blk.nk; ++j) acc[e] += s[u][j] * blk.values[j][e];
      }
    }
  }
}

// Prefill blocks (transposed keys) take wide lane tiles; a decode row's few
// lanes take the narrowest tile that holds them, so no work goes to padding.
void ForEachLaneTile(const Problem& p, Scratch& w, const KeyBlock& blk, const int64_t* first,
                     const int64_t* last, int64_t rows, int64_t group, int64_t lanes,
                     bool transpose) {
  if (transpose || lanes > 4) {
    AttendLanes<8>(p, w, blk, first, last, rows, group, lanes, transpose);
  } else if (lanes > 2) {
    AttendLanes<4>(p, w, blk, first, last, rows, group, lanes, transpose);
  } else if (lanes == 2) {
    AttendLanes<2>(p, w, blk, first, last, rows, group, lanes, transpose);
  } else {
    AttendLanes<1>(p, w, blk, first, last, rows, group, lanes, transpose);
  }
}

}  // namespace esurge_attention

#endif  // ESURGE_MODELS_CPU_KERNELS_ATTENTION_TILES_H_
