// The part of a panel matmul's FFI handler that float32 panels
// (packed_matmul.cc) and bfloat16 ones (widened_matmul.cc) share: the shape
// checks, zeros for the bucket's padding rows, and the (row chunk, panel)
// work items spread over XLA's thread pool.

#ifndef ESURGE_MODELS_CPU_KERNELS_PANEL_CALL_H_
#define ESURGE_MODELS_CPU_KERNELS_PANEL_CALL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "panel_tiles.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace esurge_kernels {
namespace panel {

// y = x W for x [M, K], W's panels [P, K, kPanel] (wd: their dimensions) and
// y [M, N]; the rows past num_rows are zeros. chunk(pb, p, r0, r1) computes
// rows [r0, r1) of panel p. Items run panels fastest: the first row tile
// streams a panel in, the others find it in cache, and the chunk's rows of x
// stay cached across its panels.
template <typename XBuf, typename Dims, typename YBuf, typename Chunk>
xla::ffi::Error RunPanelMatmul(xla::ffi::ThreadPool& pool, const char* name, const XBuf& x,
                               const Dims& wd, YBuf& y, int32_t num_rows, bool silu_mul,
                               Chunk chunk) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) {
    return xla::ffi::Error::InvalidArgument(std::string(name) +
                                            ": expected x [M, K], w [P, K, 32], y [M, N]");
  }
  const int64_t per_panel = silu_mul ? kLanes : kPanel;  // output columns of a panel
  if (wd[2] != kPanel || wd[1] != xd[1] || yd[0] != xd[0] || yd[1] > wd[0] * per_panel ||
      yd[1] <= (wd[0] - 1) * per_panel) {
    return xla::ffi::Error::InvalidArgument(std::string(name) + ": shapes do not match");
  }
  const int64_t rows = std::clamp<int64_t>(num_rows, 0, xd[0]);
  const Problem pb{x.typed_data(), y->typed_data(), rows, xd[1], yd[1], silu_mul};
  std::memset(pb.y + rows * pb.n, 0, sizeof(float) * (xd[0] - rows) * pb.n);
  const int64_t num_panels = wd[0];
  const int64_t items = (rows + kRowChunk - 1) / kRowChunk * num_panels;
  // Items cost about the same: a few chunks per thread balance a busy pool.
  ParallelFor(pool, items, 4, [&pb, &chunk, num_panels](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item % num_panels, r0 = item / num_panels * kRowChunk;
      chunk(pb, p, r0, std::min(pb.m, r0 + kRowChunk));
    }
  });
  return xla::ffi::Error::Success();
}

}  // namespace panel
}  // namespace esurge_kernels

#endif  // ESURGE_MODELS_CPU_KERNELS_PANEL_CALL_H_
