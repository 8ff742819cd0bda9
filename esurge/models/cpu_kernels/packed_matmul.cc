// y = x W for XLA:CPU with W pre-packed in column panels, called from JAX
// through the XLA FFI (esurge/models/packed_linear.py packs and dispatches).
//
// Why a kernel: a decode step's matmuls have few rows (one per request), so
// each weight element is used a few dozen times and the step is bound by how
// fast the weights stream in. XLA keeps weights [in, out] row-major, where a
// block of output columns is a strided walk across memory pages that the
// hardware prefetcher does not follow, and its matmul library packs the
// weight again on every call. Here the weight is packed once, at load time,
// into panels of kPanel output columns, each panel [in, kPanel] contiguous:
// one sequential stream per panel, read once from memory and reused from cache
// by every block of rows. Measured on a 2-core AVX-512 VM at 32 rows: 2x the
// rate of XLA's matmul on the same shapes; at 2048 rows level with it on small
// weights and within ~10% on large ones. Rows are taken in chunks of
// kRowChunk so a chunk of x stays in cache while the panels pass by.
//
// Contract: x [M, K] float32, w [P, K, kPanel] float32 where panel p holds
// output columns [p * kPanel, (p + 1) * kPanel) (zero-padded past N),
// num_rows [] int32, y [M, N] float32 with N <= P * kPanel. Rows at or past
// num_rows are bucket padding: their outputs are zero and cost nothing. Each
// output element is one sequential multiply-add chain over k = 0..K-1,
// whatever M and the thread count are, so a row's result does not depend on
// the other rows of the batch.
//
// With silu_mul set (a gated MLP's gate/up projection), each panel holds 16
// gate columns in its first half and the matching 16 up columns in its second,
// and y [M, N] gets silu(gate) * up for N <= 16 P features: the activation
// runs on the accumulators, and the [M, 2N] product is never written.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fast_exp.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

// Rows per register tile: MR rows x kPanelVecs accumulators, plus a panel
// row's kPanelVecs vectors and a broadcast, must fit the register file (32
// zmm with AVX-512, 16 ymm otherwise).
#if defined(__AVX512F__)
constexpr int kRowTile = 8;
#else
constexpr int kRowTile = 2;
#endif

// How far ahead (in k) the first row tile of a panel asks for panel rows.
constexpr int kPrefetchRows = 16;
constexpr int64_t kRowChunk = 256;

struct Problem {
  const float* x;  // [M, K]
  const float* w;  // [P, K, kPanel]
  float* y;        // [M, N]
  int64_t m, k, n;  // m: the real rows (num_rows), not the padded M
  bool silu_mul;
};

// silu(gate) * up lane by lane: gate * sigmoid(gate), the sigmoid from
// e = exp(-|gate|) so the exponential never overflows.
inline void SiluMul(const float* gate, const float* up, float* out) {
  for (int j = 0; j < kLanes; ++j) {
    const float g = gate[j];
    const float e = esurge_kernels::ExpNonPositive(-std::fabs(g));
    const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    out[j] = g * sigmoid * up[j];
  }
}

// y[rows, panel columns] for MR rows starting at row r0 of panel p.
template <int MR>
void Tile(const Problem& pb, int64_t r0, int64_t p, bool prefetch) {
  const float* panel = pb.w + p * pb.k * kPanel;
  const float* x = pb.x + r0 * pb.k;
  Vec acc[MR][kPanelVecs];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kPanelVecs; ++v) acc[r][v] = Vec{};
  for (int64_t k = 0; k < pb.k; ++k) {
    Vec b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v)
      std::memcpy(&b[v], panel + k * kPanel + v * kNative, sizeof(Vec));
    if (prefetch) {
      __builtin_prefetch(panel + (k + kPrefetchRows) * kPanel);
      __builtin_prefetch(panel + (k + kPrefetchRows) * kPanel + kLanes);
    }
    for (int r = 0; r < MR; ++r) {
      const Vec a = Vec{} + x[r * pb.k + k];  // a native broadcast
      for (int v = 0; v < kPanelVecs; ++v) acc[r][v] += a * b[v];
    }
  }
  // Each row's panel of results as plain floats: [0, kLanes) is the first
  // half (gate, with silu_mul), [kLanes, kPanel) the second (up).
  float rows[MR][kPanel];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kPanelVecs; ++v)
      std::memcpy(rows[r] + v * kNative, &acc[r][v], sizeof(Vec));
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

// The leftover rows (M mod kRowTile) as one narrower tile.
void TailTile(const Problem& pb, int64_t r0, int64_t p, int rows, bool prefetch) {
  switch (rows) {
    case 1: return Tile<1>(pb, r0, p, prefetch);
    case 2: return Tile<2>(pb, r0, p, prefetch);
#if defined(__AVX512F__)
    case 3: return Tile<3>(pb, r0, p, prefetch);
    case 4: return Tile<4>(pb, r0, p, prefetch);
    case 5: return Tile<5>(pb, r0, p, prefetch);
    case 6: return Tile<6>(pb, r0, p, prefetch);
    case 7: return Tile<7>(pb, r0, p, prefetch);
#endif
    default: return;
  }
}

// Work items [begin, end) of (row chunk, panel), panels fastest: the first
// row tile streams a panel in (prefetching ahead), the others find it in cache,
// and the chunk's rows of x stay cached across its panels.
void Items(const Problem& pb, int64_t num_panels, int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const int64_t p = item % num_panels, r0 = item / num_panels * kRowChunk;
    const int64_t r1 = std::min(pb.m, r0 + kRowChunk);
    int64_t r = r0;
    for (; r + kRowTile <= r1; r += kRowTile) Tile<kRowTile>(pb, r, p, r == r0);
    if (r < r1) TailTile(pb, r, p, static_cast<int>(r1 - r), r == r0);
  }
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> num_rows,
                            ffi::ResultBuffer<ffi::F32> y, bool silu_mul) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("packed matmul: expected x [M, K], w [P, K, 32], y [M, N]");
  }
  const int64_t per_panel = silu_mul ? kLanes : kPanel;  // output columns of a panel
  if (wd[2] != kPanel || wd[1] != xd[1] || yd[0] != xd[0] || yd[1] > wd[0] * per_panel ||
      yd[1] <= (wd[0] - 1) * per_panel) {
    return ffi::Error::InvalidArgument("packed matmul: shapes do not match");
  }
  const int64_t rows = std::clamp<int64_t>(num_rows.typed_data()[0], 0, xd[0]);
  const Problem pb{x.typed_data(), w.typed_data(), y->typed_data(), rows, xd[1], yd[1],
                   silu_mul};
  std::memset(pb.y + rows * pb.n, 0, sizeof(float) * (xd[0] - rows) * pb.n);
  const int64_t num_panels = wd[0];
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * num_panels;
  // Items cost about the same: a few chunks per thread balance a busy pool.
  esurge_kernels::ParallelFor(pool, items, 4, [&pb, num_panels](int64_t begin, int64_t end) {
    Items(pb, num_panels, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgePackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<bool>("silu_mul"));
