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

#include "panel_call.h"
#include "panel_tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace esurge_kernels::panel;  // NOLINT: the shared tiles

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> num_rows,
                            ffi::ResultBuffer<ffi::F32> y, bool silu_mul) {
  const auto wd = w.dimensions();
  const float* panels = w.typed_data();
  return RunPanelMatmul(pool, "packed matmul", x, wd, y, num_rows.typed_data()[0], silu_mul,
                        [panels](const Problem& pb, int64_t p, int64_t r0, int64_t r1) {
                          const float* panel = panels + p * pb.k * kPanel;
                          for (int64_t r = r0; r < r1; r += kFewRows) {
                            FewRows(pb, PanelRows{panel, r == r0}, r, p,
                                    static_cast<int>(std::min<int64_t>(kFewRows, r1 - r)));
                          }
                        });
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
