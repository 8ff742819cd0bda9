// y = x W for XLA:CPU in bfloat16 with W kept as a GGUF's integer codes, in
// coded_matmul.cc's panels (the same arrays: codes [P, K, 16 | 32] uint8,
// scale and offset [P, K / 32, 32] float32, W[k, c] = scale * code + offset
// per block of 32 inputs), multiplied with the CPU's bfloat16 dot products
// (VDPBF16PS, as bf16_matmul.cc).
//
// Why: a bfloat16 model dequantized at load streams 2 bytes a weight at every
// decode step; a GGUF's 4-bit codes with their float32 scales are 0.75. A code
// is a small integer, exact in bfloat16, so the dot product runs on the codes
// themselves and the block's affine form is applied to its sums:
//   y[c] = sum over blocks b of  scale[b, c] * D[b, c] + offset[b, c] * X[b],
//   D[b, c] = sum_{k in b} x[k] * code[k, c],   X[b] = sum_{k in b} x[k].
// The weights are never rounded (a bfloat16 model's dequantized weights are:
// 8 significant bits), so the result is the float32 product of the bfloat16
// activations with the exact dequantized weight, up to float32 rounding in a
// different order, then rounded to bfloat16 once.
//
// Expanding codes to bfloat16 pairs (each 32-bit lane: the codes of inputs
// 2j and 2j + 1 for one column, as VDPBF16PS pairs them) costs a few integer
// instructions per 16 columns: a 4-bit code n becomes the bfloat16 bits
// 0x4300 | n, which is 128 + n exactly (so D is taken as D' - 128 X); an
// 8-bit one is widened to float32, whose top half is its exact bfloat16.
//
// Contract: x [M, K] bf16 with K a multiple of 32; codes, scale, offset as
// above (bits 4 or 8); num_rows [] int32 (rows past it: zeros, no work);
// y [M, N] bf16 (EsurgeCodedBf16MatmulF32: float32, the sums unrounded). With
// silu_mul each panel holds 16 gate then 16 up columns.
// Built only where the compiler targets AVX512_BF16; elsewhere the handler
// reports an error and esurge/models/cpu_kernels/__init__.py never calls it.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_store.h"
#include "coded_args.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512BF16__)

using esurge_kernels::bf16::kHalf;
using esurge_kernels::bf16::kPanel;
using esurge_kernels::bf16::Output;
using esurge_kernels::bf16::StoreRow;

constexpr int64_t kBlock = esurge_kernels::kCodeBlock;  // inputs per scale and offset
constexpr int64_t kBlockPairs = kBlock / 2;
constexpr int kRowTile = 12;               // rows per register tile (24 of the 32 zmm)
constexpr int64_t kRowChunk = 256;
constexpr int kPrefetchPairs = 32;         // how far ahead the first tile asks for codes

struct Problem {
  const uint16_t* x;     // [M, K]
  const float* xsum;     // [m, K / 32]: X[b] of each real row
  const uint8_t* codes;  // [P, K, 16 | 32]
  const float* scale;    // [P, K / 32, 32]
  const float* offset;   // [P, K / 32, 32]
  Output out;
  int64_t m, k;          // m: the real rows
  int bits;
};

// A panel's input pairs expanded from codes, pair j at a time: b[0] holds
// columns 0-15, b[1] columns 16-31, each lane one column's two codes.
template <int kBits>
struct CodedPairs {
  static constexpr int64_t kRowBytes = kBits == 4 ? kHalf : kPanel;
  static constexpr float kBias = kBits == 4 ? 128.f : 0.f;  // what a code reads as, less
  const uint8_t* codes;  // [K, kRowBytes] of one panel
  bool prefetch;

  inline void Pair(int64_t j, __m512i* b) const {
    const uint8_t* q = codes + 2 * j * kRowBytes;
    if (prefetch) __builtin_prefetch(q + 2 * kPrefetchPairs * kRowBytes);
    if constexpr (kBits == 4) {
      // Byte c of a row: column c in its low nibble, column c + 16 in its high one.
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m512i hi = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kRowBytes)));
      const __m512i both = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
      const __m512i exponent = _mm512_set1_epi32(0x43004300);  // bfloat16 128.0 in each half
      // (a & b) | c
      b[0] = _mm512_ternarylogic_epi32(both, nibbles, exponent, 0xEA);
      b[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(both, 4), nibbles, exponent, 0xEA);
    } else {
      if (prefetch) __builtin_prefetch(q + 2 * kPrefetchPairs * kRowBytes + 64);
      const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      for (int h = 0; h < 2; ++h) {
        const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + h * kHalf))));
        const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kRowBytes + h * kHalf))));
        // second's top half, first's top half shifted down: (a & b) | c
        b[h] = _mm512_ternarylogic_epi32(_mm512_castps_si512(second), high_half,
                                         _mm512_srli_epi32(_mm512_castps_si512(first), 16), 0xEA);
      }
    }
  }
};

// MR rows x panel p: per block, the dot products of the rows' bfloat16 pairs
// with the codes (each read as Pairs::kBias more than it is), then the
// block's scale and offset applied into `total`.
template <int MR, typename Pairs>
void Tile(const Problem& pb, const Pairs& src, int64_t r0, int64_t p) {
  const int64_t blocks = pb.k / kBlock;
  const float* scale = pb.scale + p * blocks * kPanel;
  const float* offset = pb.offset + p * blocks * kPanel;
  // The block sums go to memory (L1): in registers beside 8 rows' dot
  // products they spilled inside the pair loop (8 rows 1.4x slower).
  alignas(64) float total[MR][kPanel] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = b * kBlockPairs; j < (b + 1) * kBlockPairs; ++j) {
      __m512i w[2];
      src.Pair(j, w);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, pb.x + (r0 + r) * pb.k + 2 * j, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, (__m512bh)w[0]);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, (__m512bh)w[1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const float xs = pb.xsum[(r0 + r) * blocks + b];
      const __m512 sum = _mm512_set1_ps(xs), biased = _mm512_set1_ps(Pairs::kBias * xs);
      for (int h = 0; h < 2; ++h) {
        const int64_t at = b * kPanel + h * kHalf;
        __m512 t = _mm512_load_ps(total[r] + h * kHalf);
        t = _mm512_fmadd_ps(_mm512_loadu_ps(scale + at), _mm512_sub_ps(acc[r][h], biased), t);
        t = _mm512_fmadd_ps(_mm512_loadu_ps(offset + at), sum, t);
        _mm512_store_ps(total[r] + h * kHalf, t);
      }
    }
  }
  for (int r = 0; r < MR; ++r) StoreRow(pb.out, r0 + r, p, total[r], total[r] + kHalf);
}

template <typename Pairs>
void Rows(const Problem& pb, const Pairs& src, int64_t r0, int64_t p, int rows) {
  switch (rows) {
    case 1: return Tile<1>(pb, src, r0, p);
    case 2: return Tile<2>(pb, src, r0, p);
    case 3: return Tile<3>(pb, src, r0, p);
    case 4: return Tile<4>(pb, src, r0, p);
    case 5: return Tile<5>(pb, src, r0, p);
    case 6: return Tile<6>(pb, src, r0, p);
    case 7: return Tile<7>(pb, src, r0, p);
    case 8: return Tile<8>(pb, src, r0, p);
    case 9: return Tile<9>(pb, src, r0, p);
    case 10: return Tile<10>(pb, src, r0, p);
    case 11: return Tile<11>(pb, src, r0, p);
    case 12: return Tile<12>(pb, src, r0, p);
    default: return;
  }
}

// Rows [r0, r1) of panel p in balanced tiles of at most kRowTile rows, each
// expanding the codes itself: after the first tile streams them in, the
// panel's codes are in cache, and the expansion's integer instructions run
// beside the dot products. Expanding a panel's pairs once into scratch
// memory for the later tiles instead was slower at every row count
// (SmolLM2's gate/up, both cores: 16 / 32 / 64 / 256 rows 110 / 178 / 318 /
// 1,076 us against 87 / 143 / 280 / 1,049).
template <int kBits>
void Chunk(const Problem& pb, int64_t p, int64_t r0, int64_t r1) {
  const uint8_t* codes = pb.codes + p * pb.k * CodedPairs<kBits>::kRowBytes;
  const int64_t tiles = (r1 - r0 + kRowTile - 1) / kRowTile;
  const int64_t per_tile = (r1 - r0 + tiles - 1) / tiles;
  for (int64_t r = r0; r < r1; r += per_tile) {
    const CodedPairs<kBits> coded{codes, r == r0};  // the first tile streams them in
    Rows(pb, coded, r, p, static_cast<int>(std::min(per_tile, r1 - r)));
  }
}

void Items(const Problem& pb, int64_t num_panels, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const int64_t p = item % num_panels, r0 = item / num_panels * kRowChunk;
    const int64_t r1 = std::min(pb.m, r0 + kRowChunk);
    if (pb.bits == 4) {
      Chunk<4>(pb, p, r0, r1);
    } else {
      Chunk<8>(pb, p, r0, r1);
    }
  }
}

// X[b] of rows [begin, end): each block's 32 bfloat16 inputs summed in float32.
void BlockSums(const uint16_t* x, int64_t k, int64_t begin, int64_t end, float* sums) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* in = x + r * k + b * kBlock;
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)));
      const __m512i hi = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + kHalf)));
      const __m512 both = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                        _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
      sums[r * blocks + b] = _mm512_reduce_add_ps(both);
    }
  }
}

// y = x @ W into a bfloat16 (y16) or float32 (y32) result of dimensions yd.
ffi::Error CodedBf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                           ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scale,
                           ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> num_rows,
                           ffi::Span<const int64_t> yd, uint16_t* y16, float* y32,
                           bool silu_mul, int64_t bits) {
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  const char* wrong = esurge_kernels::CodedArgsError(xd, cd, scale.dimensions(),
                                                     offset.dimensions(), yd, bits, silu_mul);
  if (wrong != nullptr) {
    return ffi::Error::InvalidArgument(std::string("coded bf16 matmul: ") + wrong);
  }
  const int64_t k = xd[1], panels = cd[0];
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  const int64_t padding = (xd[0] - rows) * yd[1];
  if (y32 != nullptr) {
    std::memset(y32 + rows * yd[1], 0, sizeof(float) * padding);
  } else {
    std::memset(y16 + rows * yd[1], 0, sizeof(uint16_t) * padding);
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.typed_data());
  std::vector<float> sums(static_cast<size_t>(rows * (k / kBlock)));
  esurge_kernels::ParallelFor(pool, rows, 1, [xs, k, &sums](int64_t begin, int64_t end) {
    BlockSums(xs, k, begin, end, sums.data());
  });
  const Problem pb{xs, sums.data(), codes.typed_data(), scale.typed_data(), offset.typed_data(),
                   Output{y16, y32, yd[1], silu_mul}, rows, k, static_cast<int>(bits)};
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * panels;
  esurge_kernels::ParallelFor(pool, items, 4, [&pb, panels](int64_t begin, int64_t end) {
    Items(pb, panels, begin, end);
  });
  return ffi::Error::Success();
}

ffi::Error CodedBf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scale,
                               ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> num_rows,
                               ffi::ResultBuffer<ffi::BF16> y, bool silu_mul, int64_t bits) {
  return CodedBf16Matmul(pool, x, codes, scale, offset, num_rows, y->dimensions(),
                         reinterpret_cast<uint16_t*>(y->typed_data()), nullptr, silu_mul, bits);
}

ffi::Error CodedBf16MatmulF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                                  ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scale,
                                  ffi::Buffer<ffi::F32> offset, ffi::Buffer<ffi::S32> num_rows,
                                  ffi::ResultBuffer<ffi::F32> y, bool silu_mul, int64_t bits) {
  return CodedBf16Matmul(pool, x, codes, scale, offset, num_rows, y->dimensions(), nullptr,
                         y->typed_data(), silu_mul, bits);
}

#else  // no AVX512_BF16 in this build

ffi::Error CodedBf16MatmulImpl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::U8>,
                               ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                               ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::BF16>, bool,
                               int64_t) {
  return ffi::Error::Internal("coded bf16 matmul: this build has no AVX512_BF16");
}

ffi::Error CodedBf16MatmulF32Impl(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::U8>,
                                  ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                                  ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>, bool,
                                  int64_t) {
  return ffi::Error::Internal("coded bf16 matmul: this build has no AVX512_BF16");
}

#endif  // __AVX512BF16__

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgeCodedBf16Matmul, CodedBf16MatmulImpl,
                              (esurge_kernels::CodedBinding<ffi::DataType::BF16, ffi::DataType::BF16>()));

// The same product with float32 results, unrounded: the LM head's logits
// (rounded to bfloat16 they tie near-ties outright).
XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgeCodedBf16MatmulF32, CodedBf16MatmulF32Impl,
                              (esurge_kernels::CodedBinding<ffi::DataType::BF16, ffi::DataType::F32>()));
