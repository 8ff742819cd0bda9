// The arithmetic of the CPU paged-attention kernel: one key block folded into
// a tile of query lanes (a lane is one (row, query head) pair) with an online
// softmax. Included by paged_attention.cc only; see that file for the contract.

#ifndef ESURGE_MODELS_CPU_KERNELS_ATTENTION_TILES_H_
#define ESURGE_MODELS_CPU_KERNELS_ATTENTION_TILES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fast_exp.h"

namespace esurge_attention {

struct Problem {
  const float* q;             // [T, H, D]
  const float* k;             // [NP, PS, KV, D] a float32 cache, or nullptr
  const float* v;             // [NP, PS, KV, D]
  const uint16_t* k16;        // [NP, PS, KV, D] a bfloat16 cache, or nullptr
  const uint16_t* v16;        // [NP, PS, KV, D]
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

// Sixteen floats at any 4-byte aligned address, read and written as one
// vector. memcpy into a Scores let GCC split the copy into two 256-bit moves
// through the stack, which the 512-bit load after it could not forward from
// (a store-forwarding stall on every accumulator reload; measured: a third of
// the prefill lane loop).
typedef float UnalignedScores
    __attribute__((vector_size(kKeyBlock * sizeof(float)), aligned(4), may_alias));

inline Scores LoadScores(const float* p) { return *reinterpret_cast<const UnalignedScores*>(p); }
inline void StoreScores(float* p, Scores v) { *reinterpret_cast<UnalignedScores*>(p) = v; }

using esurge_kernels::ExpNonPositive;
using esurge_kernels::ExpNonPositiveVec;

// Index vectors for shuffles of two Scores (GCC's __builtin_shuffle; Clang
// takes the indices as constants of __builtin_shufflevector).
typedef int32_t ScoreIndex __attribute__((vector_size(kKeyBlock * sizeof(int32_t))));
#if defined(__clang__)
#define ESURGE_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define ESURGE_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ScoreIndex){__VA_ARGS__})
#endif

// out[j] = the sum of v[j]'s elements, for sixteen vectors at once: four rounds
// that each halve the partial sums per key by adding two shuffled halves. Thirty
// shuffles and fifteen adds replace sixteen in-order reductions (a dependent
// chain of sixteen scalar adds per key: the decode path's largest compute cost).
inline Scores SumEach(const Scores (&v)[kKeyBlock]) {
  Scores w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {
    w[i] = ESURGE_SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7,
                          16, 17, 18, 19, 20, 21, 22, 23) +
           ESURGE_SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                          24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = ESURGE_SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11,
                          16, 17, 18, 19, 24, 25, 26, 27) +
           ESURGE_SHUFFLE(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15,
                          20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    y[i] = ESURGE_SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13,
                          16, 17, 20, 21, 24, 25, 28, 29) +
           ESURGE_SHUFFLE(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15,
                          18, 19, 22, 23, 26, 27, 30, 31);
  }
  return ESURGE_SHUFFLE(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14,
                        16, 18, 20, 22, 24, 26, 28, 30) +
         ESURGE_SHUFFLE(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15,
                        17, 19, 21, 23, 25, 27, 29, 31);
}

// Horizontal max and sum of one Scores vector, as trees of shuffles (the
// in-order loops compile to dependent chains of sixteen scalar operations).
inline float MaxOf(Scores v) {
  auto max = [](Scores a, Scores b) { return a > b ? a : b; };
  v = max(v, ESURGE_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = max(v, ESURGE_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  v = max(v, ESURGE_SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  return std::max(v[0], v[1]);
}

inline float SumOf(Scores v) {
  v += ESURGE_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += ESURGE_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  v += ESURGE_SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  return v[0] + v[1];
}

// Scores s of one lane over one key block -> probabilities in place, folding
// the block into the lane's running max m and denominator l; returns the factor
// the lane's accumulated values must be rescaled by. At least one key of the
// block is visible to the lane.
// Inlined into each lane tile so the compiler can overlap the lanes' softmax
// chains (measured: 1.5% of a prefill step, 3% of a decode step).
inline __attribute__((always_inline)) float SoftmaxBlock(
    const Problem& p, float* s, int64_t kb, int64_t nk, int64_t first, int64_t last, float& m,
    float& l) {
  Scores v = LoadScores(s);
  v *= p.scale;
  if (p.softcap > 0.f) {
    for (int j = 0; j < kKeyBlock; ++j) v[j] = std::tanh(v[j] / p.softcap) * p.softcap;
  }
  // Only blocks on a mask edge (causal diagonal, window start, the tail) need
  // per-key masking.
  if (nk < kKeyBlock || kb < first || kb + kKeyBlock - 1 > last) {
    for (int j = 0; j < kKeyBlock; ++j) {
      const int64_t kp = kb + j;
      if (j >= nk || kp < first || kp > last) v[j] = -INFINITY;
    }
  }
  const float m_new = std::max(m, MaxOf(v));
  const float alpha = m == -INFINITY ? 0.f : ExpNonPositive(m - m_new);
  v = ExpNonPositiveVec(v - m_new);
  l = l * alpha + SumOf(v);
  m = m_new;
  StoreScores(s, v);
  return alpha;
}

struct Scratch {
  std::vector<float> kt;   // [D, kKeyBlock] the key block, transposed
  std::vector<float> kf, vf;  // [kv heads, kKeyBlock, D] a bfloat16 block's keys and values widened
  std::vector<float> acc;  // [kv heads, padded lanes, D]
  std::vector<float> m, l; // [kv heads, padded lanes] running max and denominator
  std::vector<float> qs;   // [kv heads, padded lanes, D] staged queries
};

// The lanes of one kv head inside a Scratch: lane u of that head is element u
// of m and l and row u of qs and acc.
struct Lanes {
  const float* kt;
  const float* qs;
  float* acc;
  float* m;
  float* l;
};

// One loaded key block: its first position, key count and slot pointers.
struct KeyBlock {
  int64_t kb = 0, nk = 0;
  const float* keys[kKeyBlock];
  const float* values[kKeyBlock];
};

// One lane's scores against a key block in its cache layout (no transpose):
// a vector of partial products per key, summed across by SumEach. Keys past
// the block's end score 0 (masked later). Chunks is head_dim / 16 when that is
// a compile-time case (the query stays in registers and each key's chain is
// unrolled), 0 for any head_dim.
template <int Chunks>
inline Scores ScoreKeys(const float* q, const KeyBlock& blk, int64_t d) {
  Scores part[kKeyBlock];
  if constexpr (Chunks > 0) {
    Scores qv[Chunks];
    for (int c = 0; c < Chunks; ++c) qv[c] = LoadScores(q + c * kKeyBlock);
    for (int j = 0; j < kKeyBlock; ++j) {
      Scores acc = {};
      for (int c = 0; c < Chunks && j < blk.nk; ++c) {
        acc += qv[c] * LoadScores(blk.keys[j] + c * kKeyBlock);
      }
      part[j] = acc;
    }
  } else {
    const int64_t whole = d / kKeyBlock * kKeyBlock;
    for (int j = 0; j < kKeyBlock; ++j) {
      Scores acc = {};
      if (j < blk.nk) {
        const float* k = blk.keys[j];
        for (int64_t e = 0; e < whole; e += kKeyBlock) {
          acc += LoadScores(q + e) * LoadScores(k + e);
        }
        float tail = 0.f;
        // Explicit multiply-adds, as ScoreTransposed's tail: left to contraction
        // the two compiled to different roundings (head_dim 24).
        for (int64_t e = whole; e < d; ++e) tail = std::fma(q[e], k[e], tail);
        acc[0] += tail;
      }
      part[j] = acc;
    }
  }
  return SumEach(part);
}

inline Scores ScoreKeysAnyDim(const float* q, const KeyBlock& blk, int64_t d) {
  switch (d) {
    case 64: return ScoreKeys<4>(q, blk, d);
    case 128: return ScoreKeys<8>(q, blk, d);
    default: return ScoreKeys<0>(q, blk, d);
  }
}

// Tile lanes' scores against a transposed key block (kt [D, kKeyBlock]), in
// exactly ScoreKeys' order: lane l of a key's partial products takes inputs
// l, l + 16, ... as one multiply-add chain (the tail, for a D that 16 does
// not divide, added to lane 0's), and the sixteen partials are added in
// SumEach's tree (l with l + 8, then 4 apart, 2, 1). So a row's scores, and
// everything after them, are the same bits whichever path its step takes: a
// decode row (direct) and the same position among a speculative step's
// verified rows (transposed) got different roundings, and bfloat16 models
// then drifted apart in their greedy tokens with and without speculation.
// Each loaded key row feeds every lane of the tile.
template <int Tile>
inline void ScoreTransposed(const float* qs, int64_t d, const float* kt,
                            float (&s)[Tile][kKeyBlock]) {
  const int64_t whole = d / kKeyBlock * kKeyBlock;
  constexpr int kHalfBlock = kKeyBlock / 2;
  Scores pairs[Tile][kHalfBlock];  // partial m plus partial m + 8
  for (int m = 0; m < kHalfBlock; ++m) {
    Scores lo[Tile] = {}, hi[Tile] = {};
    for (int64_t e = m; e < whole; e += kKeyBlock) {
      const Scores k_lo = LoadScores(kt + e * kKeyBlock);
      const Scores k_hi = LoadScores(kt + (e + kHalfBlock) * kKeyBlock);
      for (int u = 0; u < Tile; ++u) {
        lo[u] += qs[u * d + e] * k_lo;
        hi[u] += qs[u * d + e + kHalfBlock] * k_hi;
      }
    }
    if (m == 0 && whole < d) {
      for (int u = 0; u < Tile; ++u) {
        Scores tail = {};
        for (int64_t e = whole; e < d; ++e) {
          const Scores kv = LoadScores(kt + e * kKeyBlock);
          for (int j = 0; j < kKeyBlock; ++j) tail[j] = std::fma(qs[u * d + e], kv[j], tail[j]);
        }
        lo[u] += tail;
      }
    }
    for (int u = 0; u < Tile; ++u) pairs[u][m] = lo[u] + hi[u];
  }
  for (int u = 0; u < Tile; ++u) {
    Scores* b = pairs[u];
    for (int n = 0; n < 4; ++n) b[n] += b[n + 4];
    for (int o = 0; o < 2; ++o) b[o] += b[o + 2];
    StoreScores(s[u], b[0] + b[1]);
  }
}

// Folds one key block into lanes [0, lanes) (a lane is a (row, query head)
// pair; lanes past `lanes` are padding), Tile lanes at a time so each loaded
// key vector and value chunk feeds Tile accumulators.
template <int Tile>
void AttendLanes(const Problem& p, const Lanes& w, const KeyBlock& blk, const int64_t* first,
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
      ScoreTransposed<Tile>(w.qs + l0 * d, d, w.kt, s);
    } else {
      for (int u = 0; u < Tile; ++u) {
        const Scores sv = live[u] ? ScoreKeysAnyDim(w.qs + (l0 + u) * d, blk, d) : Scores{};
        StoreScores(s[u], sv);
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
        acc[u] = LoadScores(w.acc + (l0 + u) * d + e0) * alpha[u];
      }
      for (int64_t j = 0; j < blk.nk; ++j) {
        const Scores v = LoadScores(blk.values[j] + e0);
        for (int u = 0; u < Tile; ++u) acc[u] += s[u][j] * v;
      }
      for (int u = 0; u < Tile; ++u) {
        StoreScores(w.acc + (l0 + u) * d + e0, acc[u]);
      }
    }
    for (int u = 0; u < Tile && e0 < d; ++u) {
      float* acc = w.acc + (l0 + u) * d;
      for (int64_t e = e0; e < d; ++e) {
        acc[e] *= alpha[u];
        for (int64_t j = 0; j < blk.nk; ++j) acc[e] += s[u][j] * blk.values[j][e];
      }
    }
  }
}

#if defined(__AVX512F__)
constexpr bool kWideLaneTiles = true;
#else
// A tile's value sums hold 2 * Tile 256-bit accumulators without AVX-512: 8
// lanes need 16 of the 16 registers, before the values and the weights, and
// spill on every key.
constexpr bool kWideLaneTiles = false;
#endif

// Transposed key blocks (AVX-512 prefill) take wide lane tiles, as do other
// blocks of many lanes where the registers hold them; a decode row's few lanes
// take the narrowest tile that holds them, so no work goes to padding. The
// scratch pads lanes to a multiple of kMaxLaneTile: a tile that does not
// divide it (3) may only cover all of a block's lanes at once.
void ForEachLaneTile(const Problem& p, const Lanes& w, const KeyBlock& blk, const int64_t* first,
                     const int64_t* last, int64_t rows, int64_t group, int64_t lanes,
                     bool transpose) {
  if (transpose || (lanes > 4 && kWideLaneTiles)) {
    AttendLanes<8>(p, w, blk, first, last, rows, group, lanes, transpose);
  } else if (lanes >= 4) {
    AttendLanes<4>(p, w, blk, first, last, rows, group, lanes, transpose);
  } else if (lanes == 3) {
    // Three query heads a kv head (SmolLM2, among others): a tile of 4 would
    // spend a quarter of the value sums on a padding lane.
    AttendLanes<3>(p, w, blk, first, last, rows, group, lanes, transpose);
  } else if (lanes == 2) {
    AttendLanes<2>(p, w, blk, first, last, rows, group, lanes, transpose);
  } else {
    AttendLanes<1>(p, w, blk, first, last, rows, group, lanes, transpose);
  }
}

#undef ESURGE_SHUFFLE

}  // namespace esurge_attention

#endif  // ESURGE_MODELS_CPU_KERNELS_ATTENTION_TILES_H_
