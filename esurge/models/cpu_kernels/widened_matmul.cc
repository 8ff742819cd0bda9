// y = x W for XLA:CPU with W stored as bfloat16 in column panels and
// multiplied in float32. Called from JAX through the XLA FFI
// (esurge/models/coded_linear.py packs and dispatches).
//
// Why: a bfloat16 checkpoint on a CPU without bfloat16 dot products
// (AVX512_BF16) is served in float32, and at a decode step's few rows the
// matmuls are bound by how fast the weights stream in (packed_matmul.cc).
// Upcast at load, every weight is 4 bytes; kept as the checkpoint's own
// bfloat16, it is 2, and widening it in registers is exact (a bfloat16 is the
// upper half of the float32 with the same value). The widened rows go through
// packed_matmul's own register tiles, so the result is bit for bit the
// float32 panel kernel's on the upcast weight.
//
// Contract: x [M, K] float32; w [P, K, 32] bfloat16, the float32 panels'
// layout (padding columns zero); num_rows [] int32 (rows past it are zeros);
// y [M, N]. silu_mul as in packed_matmul.cc.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "panel_call.h"
#include "panel_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace esurge_kernels::panel;  // NOLINT: the shared tiles

// kNative bfloat16 values from h as float32: each 16-bit pattern shifted
// into the upper half of a 32-bit lane. Spelled in intrinsics for the same
// reason as coded_matmul.cc's codes (GCC scalarizes the generic form).
inline Vec Bf16AsFloats(const uint16_t* h) {
#if defined(__AVX512F__)
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
  return reinterpret_cast<Vec>(
      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
#elif defined(__AVX2__)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h));
  return reinterpret_cast<Vec>(
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
#else
  Vec out;
  for (int j = 0; j < kNative; ++j) {
    const uint32_t bits = static_cast<uint32_t>(h[j]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    out[j] = f;
  }
  return out;
#endif
}

// A bfloat16 panel as a source of float32 panel rows, prefetching ahead as
// it streams in (a panel row is 64 bytes: one cache line).
struct Bf16Rows {
  static constexpr int64_t kBlockRows = kWholePanel;
  const uint16_t* panel;  // [K, kPanel]

  const Bf16Rows& BlockAt(int64_t) const { return *this; }

  inline void Load(int64_t k, Vec* b) const {
    const uint16_t* row = panel + k * kPanel;
    __builtin_prefetch(row + kPrefetchRows * kPanel);
    for (int v = 0; v < kPanelVecs; ++v) b[v] = Bf16AsFloats(row + v * kNative);
  }

  template <int H, int MR>
  inline void LoadHalf(int64_t k, Vec* b) const {
    const uint16_t* row = panel + k * kPanel + H * kLanes;
    __builtin_prefetch(row + kPrefetchRows * kPanel);
    for (int v = 0; v < kHalfVecs; ++v) b[v] = Bf16AsFloats(row + v * kNative);
  }
};

ffi::Error WidenedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::S32> num_rows,
                             ffi::ResultBuffer<ffi::F32> y, bool silu_mul) {
  const auto wd = w.dimensions();
  const auto* panels = reinterpret_cast<const uint16_t*>(w.untyped_data());
  return RunPanelMatmul(pool, "widened matmul", x, wd, y, num_rows.typed_data()[0], silu_mul,
                        [panels](const Problem& pb, int64_t p, int64_t r0, int64_t r1) {
                          ExpandedChunk(pb, Bf16Rows{panels + p * pb.k * kPanel}, p, r0, r1);
                        });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgeWidenedMatmul, WidenedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, bfloat16 panels
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_rows
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Attr<bool>("silu_mul"));
