// The register tiles of the panel matmul kernels (packed_matmul.cc: float32
// panels; coded_matmul.cc: panels of integer codes dequantized to float32
// first). Both multiply through the same tiles, so a coded weight gives
// exactly the float32 panel kernel's result on its dequantized values.
//
// A panel is [K, kPanel] float32, contiguous: kPanel output columns for every
// input k. Each output element is one sequential multiply-add chain over
// k = 0..K-1, whatever the row count and thread count are.

#ifndef ESURGE_MODELS_CPU_KERNELS_PANEL_TILES_H_
#define ESURGE_MODELS_CPU_KERNELS_PANEL_TILES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_exp.h"

namespace esurge_kernels {
namespace panel {

constexpr int kPanel = 32;  // output columns per panel; keep in step with packed_linear.py
constexpr int kLanes = 16;  // half a panel: the gate (or up) columns of a SiLU panel

// The machine's own vector: GCC lowers a generic vector wider than the
// hardware's (16 floats on AVX2) through the stack, scalar broadcast
// included (measured on a Zen 3 without AVX-512: ~1 GFLOP/s, 4x slower than
// XLA at one row and 25x at 128). So the arithmetic runs on native-width
// vectors, kNative floats each, kPanelVecs of them per panel row.
#if defined(__AVX512F__)
constexpr int kNative = 16;
#else
constexpr int kNative = 8;
#endif
typedef float Vec __attribute__((vector_size(kNative * sizeof(float))));
constexpr int kPanelVecs = kPanel / kNative;

// A native vector at float alignment, for loads from any float address.
// Loading through it keeps the tiles in registers: a memcpy into an array of
// Vec made GCC (AVX2 build) copy each panel row through the stack and keep
// the accumulators there, a store-to-load chain per multiply-add (a 2-core
// AMD EPYC with AVX2 only, SmolLM2's gate/up at 16 rows: 8.8 GFLOP/s on one
// core against 40 to 75 through registers).
typedef float UnalignedVec
    __attribute__((vector_size(kNative * sizeof(float)), aligned(4), may_alias));
inline Vec LoadVec(const float* p) { return *reinterpret_cast<const UnalignedVec*>(p); }

// f in every lane. Written as f - 0, which folds to a single broadcast; the
// former 0 + f cannot fold (it would turn -0 into +0) and cost an add per row.
inline Vec Broadcast(float f) { return f - Vec{}; }

constexpr int kHalfVecs = kPanelVecs / 2;  // vectors per half panel (kLanes columns)

// Rows that one pass over a panel's rows serves (FewRows); more rows run in
// tiles of this many. A whole-panel tile of MR rows needs MR x kPanelVecs
// accumulators, a panel row's kPanelVecs vectors and a broadcast in the
// register file: up to 8 rows with AVX-512's 32 zmm, 2 with AVX2's 16 ymm.
// A half panel (2 vectors) leaves AVX2 room for 6 rows (12 accumulators + 2
// + a broadcast). So there 3 to 6 rows run as two half-panel passes: each
// panel row is read (or, coded, expanded) once for all of them, where 2-row
// tiles read it once per tile, and a coded panel had to be expanded to
// memory first (SmolLM2's model step, 2-core EPYC with AVX2: 3 to 6 rows
// 1.2-1.45x faster; 8 to 24 rows, from the expanded panel, ~5%).
#if defined(__AVX512F__)
constexpr int kFewRows = 8;
#else
constexpr int kFewRows = 6;
#endif

// How far ahead (in k) the first row tile of a panel asks for panel rows.
constexpr int kPrefetchRows = 16;
constexpr int64_t kRowChunk = 256;

struct Problem {
  const float* x;  // [M, K]
  float* y;        // [M, N]
  int64_t m, k, n;  // m: the real rows (num_rows), not the padded M
  bool silu_mul;
};

// silu(gate) * up lane by lane: gate * sigmoid(gate), the sigmoid from
// e = exp(-|gate|) so the exponential never overflows.
inline void SiluMul(const float* gate, const float* up, float* out) {
  for (int j = 0; j < kLanes; ++j) {
    const float g = gate[j];
    const float e = ExpNonPositive(-std::fabs(g));
    const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    out[j] = g * sigmoid * up[j];
  }
}

// A source of panel rows is read one block of kBlockRows rows at a time:
// BlockAt(kb) gives rows [kb, kb + kBlockRows) (what the block shares, such
// as a coded panel's scales, loaded once), whose Load(k, b) writes row k's
// kPanelVecs vectors and LoadHalf<H, MR>(k, b) its half H for a tile of MR
// rows. Sources with nothing to share are one block. The block loop is
// spelled out in each tile: one shared helper taking the loop body as a
// lambda made GCC spill float32 half tiles (5 rows 4.2 -> 11.0 ns a panel
// row).
constexpr int64_t kWholePanel = int64_t{1} << 40;

// A float32 panel in memory as a source of panel rows, prefetching ahead when
// it streams in from memory (the first row tile of a chunk).
struct PanelRows {
  static constexpr int64_t kBlockRows = kWholePanel;
  const float* panel;  // [K, kPanel]
  bool prefetch;

  const PanelRows& BlockAt(int64_t) const { return *this; }

  inline void Load(int64_t k, Vec* b) const {
    for (int v = 0; v < kPanelVecs; ++v) b[v] = LoadVec(panel + k * kPanel + v * kNative);
    if (prefetch) {
      __builtin_prefetch(panel + (k + kPrefetchRows) * kPanel);
      __builtin_prefetch(panel + (k + kPrefetchRows) * kPanel + kLanes);
    }
  }

  // Columns [H * kLanes, (H + 1) * kLanes) of panel row k: kHalfVecs vectors.
  template <int H, int MR>
  inline void LoadHalf(int64_t k, Vec* b) const {
    const float* row = panel + k * kPanel + H * kLanes;
    for (int v = 0; v < kHalfVecs; ++v) {
      b[v] = LoadVec(row + v * kNative);
#if defined(__AVX2__) && !defined(__AVX512F__)
      // Held in a register: GCC otherwise folds the load into every row's
      // multiply-add, and the repeated loads made 3 and 4 rows slower than 5
      // (one core of a Zen 3 EPYC, 3 / 4 rows: 4.1 / 5.4 -> 2.9 / 3.1 ns per
      // panel row; 5 rows 3.5).
      asm("" : "+x"(b[v]));
#endif
    }
    if (prefetch) __builtin_prefetch(row + kPrefetchRows * kPanel);
  }
};

// Writes MR rows of a panel's results (row r: rows[r], [0, kLanes) the first
// half: gate with silu_mul, [kLanes, kPanel) the second: up) to y.
template <int MR>
inline void StoreRows(const Problem& pb, const float (&rows)[MR][kPanel], int64_t r0,
                      int64_t p) {
  if (pb.silu_mul) {
    const int64_t col = p * kLanes;
    const int64_t width = std::min<int64_t>(kLanes, pb.n - col);
    for (int r = 0; r < MR; ++r) {
      float act[kLanes];
      SiluMul(rows[r], rows[r] + kLanes, act);
      float* out = pb.y + (r0 + r) * pb.n + col;
      // A constant size compiles to one vector store; a variable one to a
      // library call per row (measured: 1.5% of a prefill step).
      if (width == kLanes) {
        std::memcpy(out, act, sizeof(act));
      } else {
        std::memcpy(out, act, sizeof(float) * width);
      }
    }
    return;
  }
  const int64_t col = p * kPanel;
  const int64_t width = std::min<int64_t>(kPanel, pb.n - col);
  for (int r = 0; r < MR; ++r) {
    float* out = pb.y + (r0 + r) * pb.n + col;
    if (width == kPanel) {
      std::memcpy(out, rows[r], sizeof(rows[r]));
    } else {  // the last panel of an N that is not a multiple of kPanel
      std::memcpy(out, rows[r], sizeof(float) * width);
    }
  }
}

// y[rows, panel columns] for MR rows starting at row r0 of panel p, the
// panel's rows from `rows.Load(k, b)`.
template <int MR, typename Rows>
void Tile(const Problem& pb, const Rows& panel_rows, int64_t r0, int64_t p) {
  const float* x = pb.x + r0 * pb.k;
  Vec acc[MR][kPanelVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = Vec{};
  for (int64_t kb = 0; kb < pb.k; kb += Rows::kBlockRows) {
    const auto& block = panel_rows.BlockAt(kb);
    const int64_t kend = std::min(pb.k, kb + Rows::kBlockRows);
    for (int64_t k = kb; k < kend; ++k) {
      Vec b[kPanelVecs];
      block.Load(k, b);
      for (int r = 0; r < MR; ++r) {
        const Vec a = Broadcast(x[r * pb.k + k]);
        for (int v = 0; v < kPanelVecs; ++v) acc[r][v] += a * b[v];
      }
    }
  }
  // Each row's panel of results as plain floats: [0, kLanes) is the first
  // half (gate, with silu_mul), [kLanes, kPanel) the second (up).
  float rows[MR][kPanel];
  // Stored through a vector pointer: copying from &acc took the
  // accumulators' address, and GCC then stored every accumulator to the
  // stack on every k (seen in the coded kernel's one-row tile).
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kPanelVecs; ++v)
      *reinterpret_cast<UnalignedVec*>(rows[r] + v * kNative) = acc[r][v];
  StoreRows<MR>(pb, rows, r0, p);
}

// Half H of MR rows' results (columns [H * kLanes, (H + 1) * kLanes)) into rows.
template <int MR, int H, typename Rows>
inline void HalfPass(const Problem& pb, const Rows& panel_rows, const float* x,
                     float (&rows)[MR][kPanel]) {
  Vec acc[MR][kHalfVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kHalfVecs; ++v) acc[r][v] = Vec{};
  for (int64_t kb = 0; kb < pb.k; kb += Rows::kBlockRows) {
    const auto& block = panel_rows.BlockAt(kb);
    const int64_t kend = std::min(pb.k, kb + Rows::kBlockRows);
    for (int64_t k = kb; k < kend; ++k) {
      Vec b[kHalfVecs];
      block.template LoadHalf<H, MR>(k, b);
      for (int r = 0; r < MR; ++r) {
        const Vec a = Broadcast(x[r * pb.k + k]);
        for (int v = 0; v < kHalfVecs; ++v) acc[r][v] += a * b[v];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kHalfVecs; ++v)
      *reinterpret_cast<UnalignedVec*>(rows[r] + H * kLanes + v * kNative) = acc[r][v];
}

// y[rows, panel columns] for MR rows, one half panel at a time (kFewRows).
// Each output is the same multiply-add chain over k as in Tile, so the two
// give identical results.
template <int MR, typename Rows>
void HalfTile(const Problem& pb, const Rows& panel_rows, int64_t r0, int64_t p) {
  const float* x = pb.x + r0 * pb.k;
  float rows[MR][kPanel];
  HalfPass<MR, 0>(pb, panel_rows, x, rows);
  HalfPass<MR, 1>(pb, panel_rows, x, rows);
  StoreRows<MR>(pb, rows, r0, p);
}

// Rows [r0, r0 + rows) of panel p, 1 <= rows <= kFewRows, in one pass over the
// panel's rows: whole-panel tiles, or (AVX2, 3 to 6 rows) half-panel ones.
template <typename Rows>
inline void FewRows(const Problem& pb, const Rows& panel_rows, int64_t r0, int64_t p, int rows) {
  switch (rows) {
    case 1: return Tile<1>(pb, panel_rows, r0, p);
    case 2: return Tile<2>(pb, panel_rows, r0, p);
#if defined(__AVX512F__)
    case 3: return Tile<3>(pb, panel_rows, r0, p);
    case 4: return Tile<4>(pb, panel_rows, r0, p);
    case 5: return Tile<5>(pb, panel_rows, r0, p);
    case 6: return Tile<6>(pb, panel_rows, r0, p);
    case 7: return Tile<7>(pb, panel_rows, r0, p);
    case 8: return Tile<8>(pb, panel_rows, r0, p);
#else
    case 3: return HalfTile<3>(pb, panel_rows, r0, p);
    case 4: return HalfTile<4>(pb, panel_rows, r0, p);
    case 5: return HalfTile<5>(pb, panel_rows, r0, p);
    case 6: return HalfTile<6>(pb, panel_rows, r0, p);
#endif
    default: return;
  }
}

// The rows [r0, r1) of panel p from a panel source that computes its rows
// (coded or bfloat16 panels). Up to kFewRows rows read the source directly
// (one pass over the panel); more expand the panel once into this thread's
// scratch (it stays in cache for every row tile of the chunk). Both multiply
// the same float32 values in the same order.
template <typename Rows>
void ExpandedChunk(const Problem& pb, const Rows& source, int64_t p, int64_t r0, int64_t r1) {
  if (r1 - r0 <= kFewRows) return FewRows(pb, source, r0, p, static_cast<int>(r1 - r0));
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(pb.k * kPanel));
  // Rows stored through a vector pointer: copying each row out by address
  // sent it through the stack, and the expansion cost 4.8 ns a panel row
  // (2.4 now), against 1.9 for a whole one-row coded tile.
  float* const expanded_rows = scratch.data();
  for (int64_t kb = 0; kb < pb.k; kb += Rows::kBlockRows) {
    const auto& block = source.BlockAt(kb);
    const int64_t kend = std::min(pb.k, kb + Rows::kBlockRows);
    for (int64_t k = kb; k < kend; ++k) {
      Vec row[kPanelVecs];
      block.Load(k, row);
      for (int v = 0; v < kPanelVecs; ++v) {
        *reinterpret_cast<UnalignedVec*>(expanded_rows + k * kPanel + v * kNative) = row[v];
      }
    }
  }
  const PanelRows expanded{expanded_rows, false};
  for (int64_t r = r0; r < r1; r += kFewRows) {
    FewRows(pb, expanded, r, p, static_cast<int>(std::min<int64_t>(kFewRows, r1 - r)));
  }
}

}  // namespace panel
}  // namespace esurge_kernels

#endif  // ESURGE_MODELS_CPU_KERNELS_PANEL_TILES_H_
