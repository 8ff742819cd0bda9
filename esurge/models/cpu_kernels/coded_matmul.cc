// y = x W for XLA:CPU with W kept as integer codes in column panels, a scale
// and an offset per 32 inputs of each column: W[k, c] = scale * code + offset.
// Called from JAX through the XLA FFI (esurge/models/coded_linear.py packs and
// dispatches).
//
// Why: at a decode step's few rows the matmuls are bound by how fast the
// weights stream in (packed_matmul.cc). A GGUF's 4-bit weights are 0.625 bytes
// each against float32's 4, so streaming the codes and expanding them in cache
// moves a sixth of the bytes. The expansion is exact: a scale is a float16
// value times at most a 6-bit integer and a code at most 8 bits, so
// scale * code is exact in float32 and the one rounding is the + offset, the
// same arithmetic and order as the gguf package's numpy dequantizers. The
// expanded panel then goes through packed_matmul's own register tiles, so the
// result is bit for bit the float32 panel kernel's on the dequantized weight.
//
// Contract: x [M, K] float32 with K a multiple of 32; codes [P, K, 16] uint8
// (bits = 4: byte j of a row holds column j in its low nibble and column
// j + 16 in its high one, unsigned) or [P, K, 32] (bits = 8: one signed byte
// per column); scale and offset [P, K / 32, 32] float32 (padding columns have
// scale and offset 0); num_rows [] int32 (rows past it are zeros); y [M, N].
// silu_mul as in packed_matmul.cc (each panel: 16 gate then 16 up columns).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "panel_tiles.h"
#include "coded_args.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace esurge_kernels::panel;  // NOLINT: the shared tiles

constexpr int64_t kBlock = esurge_kernels::kCodeBlock;  // inputs per scale/offset

struct Codes {
  const uint8_t* codes;  // [P, K, 16 or 32]
  const float* scale;    // [P, K / kBlock, kPanel]
  const float* offset;   // [P, K / kBlock, kPanel]
  int64_t k;
  int bits;
};

// kNative codes from q as floats: unsigned nibbles (the low or the high
// half of each byte) or signed bytes. GCC scalarizes a generic byte-vector
// conversion (one cvtsi2ss per lane, slower than streaming float32), so the
// widening is spelled in intrinsics where the ISA has them.
template <int kBits, bool kHigh>
inline Vec CodesAsFloats(const uint8_t* q) {
#if defined(__AVX512F__)
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  if constexpr (kBits == 4) {
    if constexpr (kHigh) bytes = _mm_srli_epi16(bytes, 4);
    bytes = _mm_and_si128(bytes, _mm_set1_epi8(15));
    return reinterpret_cast<Vec>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)));
  } else {
    return reinterpret_cast<Vec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
  }
#elif defined(__AVX2__)
  // Widened straight from memory, then cut to a nibble in 32-bit lanes: the
  // byte-wide shift and mask before the widening cost two more instructions
  // per vector (SmolLM2's gate/up on one core of a Zen 3 EPYC, 1 / 5 rows:
  // 3.3 / 6.2 -> 2.5 / 4.7 ns per panel row, with Tile's accumulators kept
  // in registers).
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  if constexpr (kBits == 4) {
    const __m256i wide = _mm256_cvtepu8_epi32(bytes);
    const __m256i nibbles = kHigh ? _mm256_srli_epi32(wide, 4)
                                  : _mm256_and_si256(wide, _mm256_set1_epi32(15));
    return reinterpret_cast<Vec>(_mm256_cvtepi32_ps(nibbles));
  } else {
    return reinterpret_cast<Vec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
  }
#else
  Vec out;
  for (int j = 0; j < kNative; ++j) {
    if constexpr (kBits == 4) {
      out[j] = static_cast<float>(kHigh ? q[j] >> 4 : q[j] & 15);
    } else {
      out[j] = static_cast<float>(static_cast<int8_t>(q[j]));
    }
  }
  return out;
#endif
}

// Panel p's rows expanded from codes: W[k, c] = scale * code + offset, one
// block of kBlock rows at a time (panel_tiles.h's source contract).
template <int kBits>
struct CodedRows {
  static constexpr int64_t kRowBytes = kBits == 4 ? kLanes : kPanel;
  static constexpr int64_t kBlockRows = kBlock;
  const uint8_t* codes;  // [K, kRowBytes] of panel p
  const float* scale;    // [K / kBlock, kPanel] of panel p
  const float* offset;

  CodedRows(const Codes& c, int64_t p)
      : codes(c.codes + p * c.k * kRowBytes),
        scale(c.scale + p * (c.k / kBlock) * kPanel),
        offset(c.offset + p * (c.k / kBlock) * kPanel) {}

  // Rows [kb, kb + kBlock), whose columns share one scale and one offset.
  // The scales are held in registers across the block (the offsets are
  // added from memory): reloading both on every row, and recomputing their
  // address, cost a quarter of the one-row tile's time (one core of a Zen 3
  // EPYC, SmolLM2's gate/up: 2.5 -> 1.9 ns per panel row).
  struct Block {
    const uint8_t* codes;  // [K, kRowBytes], indexed by the panel's own k
    const float* scale;    // [kPanel] of this block
    const float* offset;   // [kPanel] of this block
    Vec held[kPanelVecs];  // scale, as vectors

    inline void Load(int64_t k, Vec* b) const {
      const uint8_t* q = codes + k * kRowBytes;
      for (int v = 0; v < kPanelVecs; ++v) {
        const int col = v * kNative;
        Vec code;
        if constexpr (kBits == 4) {  // column c < 16: low nibble of byte c; else high of c - 16
          code = col < kLanes ? CodesAsFloats<4, false>(q + col % kLanes)
                              : CodesAsFloats<4, true>(q + col % kLanes);
        } else {
          code = CodesAsFloats<8, false>(q + col);
        }
        // scale * code is exact: one rounding, fused or not
        b[v] = held[v] * code + LoadVec(offset + col);
      }
    }

    // Columns [H * kLanes, (H + 1) * kLanes) of row k, expanded as Load
    // does: with 4 bits, half H is the low (H = 0) or high (H = 1) nibbles of
    // the row's kLanes bytes. A tile of MR rows that leaves no registers for
    // the scales reads them and the offsets from memory on every row (AVX2's
    // 16 registers: six rows' 12 accumulators, a panel half, a broadcast and
    // the nibble mask). Left to itself GCC copies them to the stack once a
    // block and spills an accumulator instead, a store and a reload on every
    // multiply-add chain step: six rows ran 1.35x slower.
    template <int H, int MR>
    inline void LoadHalf(int64_t k, Vec* b) const {
      constexpr bool kHeld = MR * kHalfVecs + 2 * kHalfVecs + 2 <= 16;
      const uint8_t* q = codes + k * kRowBytes;
      const float* scale_row = scale;
      const float* offset_row = offset;
#if defined(__x86_64__)
      if constexpr (!kHeld) asm("" : "+r"(scale_row), "+r"(offset_row));
#endif
      for (int v = 0; v < kHalfVecs; ++v) {
        const int col = H * kLanes + v * kNative;
        Vec code;
        if constexpr (kBits == 4) {
          code = CodesAsFloats<4, H == 1>(q + v * kNative);
        } else {
          code = CodesAsFloats<8, false>(q + col);
        }
        const Vec s = kHeld ? held[H * kHalfVecs + v] : LoadVec(scale_row + col);
        b[v] = s * code + LoadVec(offset_row + col);
      }
    }
  };

  inline Block BlockAt(int64_t kb) const {
    Block block{codes, scale + kb / kBlock * kPanel, offset + kb / kBlock * kPanel, {}};
    for (int v = 0; v < kPanelVecs; ++v) block.held[v] = LoadVec(block.scale + v * kNative);
    return block;
  }
};

// Work items as in packed_matmul.cc: (row chunk, panel), panels fastest.
void Items(const Problem& pb, const Codes& c, int64_t num_panels, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const int64_t p = item % num_panels, r0 = item / num_panels * kRowChunk;
    const int64_t r1 = std::min(pb.m, r0 + kRowChunk);
    if (c.bits == 4) {
      ExpandedChunk(pb, CodedRows<4>(c, p), p, r0, r1);
    } else {
      ExpandedChunk(pb, CodedRows<8>(c, p), p, r0, r1);
    }
  }
}

ffi::Error CodedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scale,
                           ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> num_rows,
                           ffi::ResultBuffer<ffi::F32> y, bool silu_mul, int64_t bits) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const auto yd = y->dimensions();
  const char* wrong = esurge_kernels::CodedArgsError(xd, cd, scale.dimensions(),
                                                     offset.dimensions(), yd, bits, silu_mul);
  if (wrong != nullptr) return ffi::Error::InvalidArgument(std::string("coded matmul: ") + wrong);
  const int64_t k = xd[1], panels = cd[0];
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  const Problem pb{x.typed_data(), y->typed_data(), rows, k, yd[1], silu_mul};
  const Codes c{codes.typed_data(), scale.typed_data(), offset.typed_data(), k,
                static_cast<int>(bits)};
  std::memset(pb.y + rows * pb.n, 0, sizeof(float) * (xd[0] - rows) * pb.n);
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * panels;
  esurge_kernels::ParallelFor(pool, items, 4, [&pb, &c, panels](int64_t begin, int64_t end) {
    Items(pb, c, panels, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgeCodedMatmul, CodedMatmulImpl,
                              (esurge_kernels::CodedBinding<ffi::DataType::F32, ffi::DataType::F32>()));
