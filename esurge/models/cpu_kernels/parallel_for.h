// Splitting a kernel's work over XLA's intra-op thread pool. Shared by the
// kernels of this directory.

#ifndef ESURGE_MODELS_CPU_KERNELS_PARALLEL_FOR_H_
#define ESURGE_MODELS_CPU_KERNELS_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace esurge_kernels {

// Chunks are claimed through an atomic counter by the calling thread and by
// helpers scheduled on the pool. The caller only waits for chunks some running
// thread has claimed, so a busy pool can delay but never deadlock the call;
// helpers that start late find nothing left and return without touching the
// caller's (by then gone) data.
template <typename Fn>
struct ClaimedChunks {
  Fn fn;
  int64_t items, chunk_items, num_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  ClaimedChunks(Fn f, int64_t n, int64_t per_chunk)
      : fn(std::move(f)), items(n), chunk_items(per_chunk),
        num_chunks((n + per_chunk - 1) / per_chunk) {}

  void Drain() {
    for (;;) {
      const int64_t c = next.fetch_add(1);
      if (c >= num_chunks) return;
      const int64_t begin = c * chunk_items;
      fn(begin, std::min(items, begin + chunk_items));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs fn(begin, end) over [0, items) in about chunks_per_thread chunks per
// pool thread (more chunks balance uneven items, fewer cost fewer claims).
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, int64_t chunks_per_thread, Fn fn) {
  if (items <= 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t wanted = std::max<int64_t>(1, std::min(items, threads * chunks_per_thread));
  auto work = std::make_shared<ClaimedChunks<Fn>>(std::move(fn), items,
                                                  (items + wanted - 1) / wanted);
  for (int64_t i = 1; i < std::min(threads, work->num_chunks); ++i) {
    pool.Schedule([work] { work->Drain(); });
  }
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->num_chunks) {
    std::this_thread::yield();
  }
}

}  // namespace esurge_kernels

#endif  // ESURGE_MODELS_CPU_KERNELS_PARALLEL_FOR_H_
