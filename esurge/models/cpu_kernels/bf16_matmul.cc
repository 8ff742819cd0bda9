// y = x W for XLA:CPU in bfloat16, W packed in column panels as in
// packed_matmul.cc, with each panel's input rows interleaved in pairs: the
// panel [K, 32] is stored as [K / 2, 32, 2], element (k, c) at
// ((k / 2) * 32 + c) * 2 + k % 2 (esurge/models/packed_linear.py packs it).
// That is the operand layout both of the CPU's bfloat16 dot products take:
//
// - AMX (TDPBF16PS, Sapphire Rapids and later): 16x16 float32 tiles of
//   results, each instruction 16 x 16 x 32 multiply-adds. Measured on a
//   2-core Xeon VM: about 12x the float32 FMA rate of one core, so prefill
//   steps, which are bound by arithmetic, run on it.
// - AVX512_BF16 (VDPBF16PS): 16 lanes of pair dot products per instruction.
//   On the same Xeon it issues at half the rate of FMA, so it gives float32's
//   arithmetic rate on half the bytes: decode steps (bound by streaming the
//   weights) take it, and so does any K AMX's 32-wide tiles do not divide.
//
// Both multiply bfloat16 by bfloat16 exactly and accumulate in float32 (with
// denormal inputs and results flushed to zero, as the instructions do); the
// result is rounded to bfloat16 once, to nearest even. Rows at or past
// num_rows are padding: zero out, no work. With silu_mul, each panel holds 16
// gate columns then the matching 16 up columns, and y gets silu(gate) * up
// (as in packed_matmul.cc).
//
// Contract: x [M, K] bf16 (K even), w [P, K, 32] bf16 interleaved as above,
// num_rows [] int32, y [M, N] bf16. Built only where the compiler targets
// AVX512_BF16 (-march=native on such a CPU); elsewhere the handler reports
// an error, and esurge/models/cpu_kernels/__init__.py never calls it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "bf16_store.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define ESURGE_HAVE_AMX 1
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512BF16__)

using esurge_kernels::bf16::kHalf;
using esurge_kernels::bf16::kPanel;
using esurge_kernels::bf16::Output;
using esurge_kernels::bf16::StoreRow;

constexpr int kRowTile = 8;   // rows per AVX512_BF16 register tile
constexpr int64_t kRowChunk = 256;
constexpr int kPrefetchPairs = 64;  // see DotItems

struct Problem {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [P, K / 2, 64]
  Output out;         // y [M, N] bfloat16, or y32 float32 (a row-parallel shard's partial sum)
  int64_t padded_m;   // M: the rows x has (reads never pass them)
  int64_t m, k;       // m: the real rows
};

// MR rows x one panel with VDPBF16PS over input pairs [j0, j1): per pair,
// the panel's two vectors of 16 column pairs, and each row's pair
// broadcast. The sums start at zero where j0 is 0, else from `carry`
// ([MR][32] float32), and end in y where j1 is the last pair, else in carry.
template <int MR>
void DotTile(const Problem& pb, int64_t r0, int64_t p, int64_t j0, int64_t j1, bool prefetch,
             float* carry) {
  const uint16_t* panel = pb.w + p * pb.k * kPanel;
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(carry + r * kPanel);
    acc[r][1] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(carry + r * kPanel + kHalf);
  }
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* row = panel + j * 2 * kPanel;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(row);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(row + kPanel);
    if (prefetch) {
      __builtin_prefetch(row + kPrefetchPairs * 2 * kPanel);
      __builtin_prefetch(row + kPrefetchPairs * 2 * kPanel + kPanel);
    }
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, pb.x + (r0 + r) * pb.k + 2 * j, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  const bool done = j1 == pb.k / 2;
  for (int r = 0; r < MR; ++r) {
    float first[kHalf], second[kHalf];
    float* lo = done ? first : carry + r * kPanel;
    float* hi = done ? second : carry + r * kPanel + kHalf;
    _mm512_storeu_ps(lo, acc[r][0]);
    _mm512_storeu_ps(hi, acc[r][1]);
    if (done) StoreRow(pb.out, r0 + r, p, first, second);
  }
}

void DotTail(const Problem& pb, int64_t r0, int64_t p, int64_t j0, int64_t j1, bool prefetch,
             float* carry, int rows) {
  switch (rows) {
    case 1: return DotTile<1>(pb, r0, p, j0, j1, prefetch, carry);
    case 2: return DotTile<2>(pb, r0, p, j0, j1, prefetch, carry);
    case 3: return DotTile<3>(pb, r0, p, j0, j1, prefetch, carry);
    case 4: return DotTile<4>(pb, r0, p, j0, j1, prefetch, carry);
    case 5: return DotTile<5>(pb, r0, p, j0, j1, prefetch, carry);
    case 6: return DotTile<6>(pb, r0, p, j0, j1, prefetch, carry);
    case 7: return DotTile<7>(pb, r0, p, j0, j1, prefetch, carry);
    default: return;
  }
}

// A panel item of at most kBlockedRows rows (a decode step's) goes through the
// inputs in blocks of kBlockPairs, every row tile per block: the block the
// first tile streams from memory (prefetching kPrefetchPairs ahead) stays in
// L1 for the others, and the stream runs on under their arithmetic. At 32
// rows over weights streamed from memory (a C++ harness of this loop, both
// cores, the 150M model's shapes) whole panels per tile took 4-5% longer, and
// with the prefetch 8 pairs ahead (before) another 9-10%; the 150M model's W1
// in bfloat16 went from 857 to 873 tok/s (one process, alternating). Larger
// items are bound by arithmetic and take whole panels.
constexpr int kCarried = 4;  // row tiles of a blocked item
constexpr int64_t kBlockedRows = kCarried * kRowTile;
constexpr int64_t kBlockPairs = 32;

void DotItems(const Problem& pb, int64_t num_panels, int64_t begin, int64_t end) {
  alignas(64) float carry[kCarried][kRowTile * kPanel];
  const int64_t pairs = pb.k / 2;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t p = item % num_panels, r0 = item / num_panels * kRowChunk;
    const int64_t r1 = std::min(pb.m, r0 + kRowChunk);
    const int64_t block = r1 - r0 <= kBlockedRows ? kBlockPairs : pairs;
    for (int64_t j0 = 0; j0 < pairs; j0 += block) {
      const int64_t j1 = std::min(pairs, j0 + block);
      // Whole-panel items never carry (one block), so their tiles may share slots.
      int64_t r = r0;
      int t = 0;
      for (; r + kRowTile <= r1; r += kRowTile, ++t) {
        DotTile<kRowTile>(pb, r, p, j0, j1, r == r0, carry[t % kCarried]);
      }
      if (r < r1) DotTail(pb, r, p, j0, j1, r == r0, carry[t % kCarried], static_cast<int>(r1 - r));
    }
  }
}

#if defined(ESURGE_HAVE_AMX)

constexpr int kTileRows = 16;  // rows of an A tile and of a result tile
constexpr int kTileK = 32;     // inputs per A tile row (64 bytes of bfloat16)

// Linux hands out AMX's tile data state only on request, once per process.
bool AmxPermitted() {
  static std::once_flag once;
  static bool permitted = false;
  std::call_once(once, [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    permitted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  });
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: results (row block a/b x panel half 0/1); 4, 5: x rows of the
// two row blocks; 6, 7: the panel halves. Every tile is 16 rows of 64 bytes.
// The configuration is per thread and other code on XLA's threads may load
// its own, so each run of items loads ours first.
void ConfigureTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  _tile_loadconfig(&config);
}

// x rows [r0, r0 + 16) as a tile source: x itself where all 16 rows lie
// inside it, else a zero-padded copy.
const uint16_t* TileRows(const Problem& pb, int64_t r0, uint16_t* staged) {
  if (r0 + kTileRows <= pb.padded_m) return pb.x + r0 * pb.k;
  const int64_t have = std::max<int64_t>(0, pb.padded_m - r0);
  std::memset(staged, 0, sizeof(uint16_t) * kTileRows * pb.k);
  std::memcpy(staged, pb.x + r0 * pb.k, sizeof(uint16_t) * have * pb.k);
  return staged;
}

// Rows [r0, r0 + 16 * blocks) (blocks 1 or 2) x one panel on AMX.
void AmxBlock(const Problem& pb, int64_t r0, int blocks, int64_t p, uint16_t* staged) {
  const uint16_t* panel = pb.w + p * pb.k * kPanel;
  const uint16_t* a0 = TileRows(pb, r0, staged);
  const uint16_t* a1 = blocks == 2 ? TileRows(pb, r0 + kTileRows, staged + kTileRows * pb.k)
                                   : nullptr;
  const int64_t x_stride = pb.k * sizeof(uint16_t), w_stride = 2 * kPanel * sizeof(uint16_t);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < pb.k; k0 += kTileK) {
    const uint16_t* pairs = panel + (k0 / 2) * 2 * kPanel;  // 16 pair rows of the panel
    _tile_loadd(6, pairs, w_stride);
    _tile_loadd(7, pairs + kPanel, w_stride);
    _tile_loadd(4, a0 + k0, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (a1 != nullptr) {
      _tile_loadd(5, a1 + k0, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][kTileRows][kHalf];
  _tile_stored(0, c[0], kHalf * sizeof(float));
  _tile_stored(1, c[1], kHalf * sizeof(float));
  if (a1 != nullptr) {
    _tile_stored(2, c[2], kHalf * sizeof(float));
    _tile_stored(3, c[3], kHalf * sizeof(float));
  }
  for (int b = 0; b < blocks; ++b) {
    for (int i = 0; i < kTileRows; ++i) {
      const int64_t row = r0 + b * kTileRows + i;
      if (row >= pb.m) return;
      StoreRow(pb.out, row, p, c[2 * b][i], c[2 * b + 1][i]);
    }
  }
}

void AmxItems(const Problem& pb, int64_t num_panels, int64_t begin, int64_t end) {
  ConfigureTiles();
  uint16_t* staged = new uint16_t[2 * kTileRows * pb.k];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t p = item % num_panels, r0 = item / num_panels * kRowChunk;
    const int64_t r1 = std::min(pb.m, r0 + kRowChunk);
    for (int64_t r = r0; r < r1; r += 2 * kTileRows) {
      AmxBlock(pb, r, r + kTileRows < r1 ? 2 : 1, p, staged);
    }
  }
  delete[] staged;
  _tile_release();
}

// Rows from which a step takes the tiles: below it the few rows would leave
// most of each 16-row tile idle, and streaming the weights decides the time.
constexpr int64_t kAmxMinRows = 8;

bool UseAmx(const Problem& pb) {
  return pb.m >= kAmxMinRows && pb.k % kTileK == 0 && AmxPermitted();
}

#else

bool UseAmx(const Problem&) { return false; }
void AmxItems(const Problem&, int64_t, int64_t, int64_t) {}

#endif  // ESURGE_HAVE_AMX

// y = x @ w into a bfloat16 (y16) or float32 (y32) result of dimensions yd.
ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::Buffer<ffi::S32> num_rows, ffi::Span<const int64_t> yd,
                      uint16_t* y16, float* y32, bool silu_mul) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("bf16 matmul: expected x [M, K], w [P, K, 32], y [M, N]");
  }
  const int64_t per_panel = silu_mul ? kHalf : kPanel;
  if (wd[2] != kPanel || wd[1] != xd[1] || xd[1] % 2 || yd[0] != xd[0] ||
      yd[1] > wd[0] * per_panel || yd[1] <= (wd[0] - 1) * per_panel) {
    return ffi::Error::InvalidArgument("bf16 matmul: shapes do not match");
  }
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  const Problem pb{x.typed_data(), w.typed_data(), Output{y16, y32, yd[1], silu_mul}, xd[0],
                   rows, xd[1]};
  const int64_t padding = (xd[0] - rows) * yd[1];
  if (y32 != nullptr) {
    std::memset(y32 + rows * yd[1], 0, sizeof(float) * padding);
  } else {
    std::memset(y16 + rows * yd[1], 0, sizeof(uint16_t) * padding);
  }
  const int64_t num_panels = wd[0];
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * num_panels;
  const bool amx = UseAmx(pb);
  esurge_kernels::ParallelFor(pool, items, 4, [&pb, num_panels, amx](int64_t begin,
                                                                     int64_t end) {
    if (amx) {
      AmxItems(pb, num_panels, begin, end);
    } else {
      DotItems(pb, num_panels, begin, end);
    }
  });
  return ffi::Error::Success();
}

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> num_rows,
                          ffi::ResultBuffer<ffi::BF16> y, bool silu_mul) {
  return Bf16Matmul(pool, x, w, num_rows, y->dimensions(), y->typed_data(), nullptr, silu_mul);
}

ffi::Error Bf16MatmulF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                             ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> num_rows,
                             ffi::ResultBuffer<ffi::F32> y, bool silu_mul) {
  return Bf16Matmul(pool, x, w, num_rows, y->dimensions(), nullptr, y->typed_data(), silu_mul);
}

#else  // no AVX512_BF16 in this build

ffi::Error Bf16MatmulImpl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                          ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::BF16>, bool) {
  return ffi::Error::Internal("bf16 matmul: this build has no AVX512_BF16");
}

ffi::Error Bf16MatmulF32Impl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>,
                             ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>, bool) {
  return ffi::Error::Internal("bf16 matmul: this build has no AVX512_BF16");
}

#endif  // __AVX512BF16__

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgeBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, packed in pairs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_rows
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // y
                                  .Attr<bool>("silu_mul"));

// The same product with float32 results: the partial sum of a row-parallel
// shard, added to the other shards' before the one rounding to bfloat16.
XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgeBf16MatmulF32, Bf16MatmulF32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, packed in pairs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_rows
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<bool>("silu_mul"));
