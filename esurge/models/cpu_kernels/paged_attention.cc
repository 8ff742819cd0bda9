// Paged attention for XLA:CPU, called from JAX through the XLA FFI: writes
// the step's keys and values into the cache, then attends.
//
// Why a kernel: on CPU the pure-JAX formulation must first gather each
// request's pages into a fresh buffer, then read that buffer again for the
// two small batched matmuls; the decode step is bound by memory traffic and
// the gathers triple it. This kernel reads each visible key and value once,
// straight from the paged cache, and splits the rows over XLA's intra-op
// thread pool.
//
// Semantics are exactly those of esurge/models/paged_attention.py (the
// reference, tested against it): row t (t < num_tokens) of request
// token_req[t] at position positions[t] attends to the keys at positions
// [first, positions[t]] of that request, where first honours the sliding
// window and the chunked-local size; scores are scaled, soft-capped when
// softcap > 0, and softmax-normalised. Rows past num_tokens, or that see no
// key, produce zeros.
//
// Attribute encoding at this boundary: sliding_window, chunk_size and softcap
// are 0 when the layer has none (the Python wrapper maps None to 0).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;             // [T, H, D]
  const float* k;             // [NP, PS, KV, D]
  const float* v;             // [NP, PS, KV, D]
  const int32_t* positions;   // [T]
  const int32_t* token_req;   // [T]
  const int32_t* tables;      // [R, P]
  float* out;                 // [T, H, D]
  int64_t num_tokens, heads, kv_heads, dim, page_size, max_pages, num_pages;
  int64_t window, chunk;
  float scale, softcap;
};

inline float Dot(const float* a, const float* b, int64_t n) {
  // Sixteen independent partial sums let the compiler vectorise without
  // reassociating a single accumulator (no -ffast-math needed).
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += a[i] * b[i];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  return s + tail;
}

inline void Axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// One (row, kv head): the group of query heads sharing that kv head.
void AttendOne(const Problem& p, int64_t t, int64_t h, std::vector<float>& scores) {
  const int64_t group = p.heads / p.kv_heads;
  const int64_t d = p.dim;
  float* out = p.out + (t * p.heads + h * group) * d;
  std::fill(out, out + group * d, 0.f);
  if (t >= p.num_tokens) return;
  const int64_t pos = p.positions[t];
  const int64_t req = p.token_req[t];
  int64_t first = 0;
  if (p.window > 0) first = std::max(first, pos - p.window + 1);
  if (p.chunk > 0) first = std::max(first, (pos / p.chunk) * p.chunk);
  const int64_t last = std::min(pos, p.max_pages * p.page_size - 1);
  if (pos < 0 || last < first) return;
  const int64_t n = last - first + 1;
  scores.resize(static_cast<size_t>(group * n));
  const int32_t* table = p.tables + req * p.max_pages;
  const float* q = p.q + (t * p.heads + h * group) * d;
  auto slot_offset = [&](int64_t key_pos) -> int64_t {
    int64_t page = table[key_pos / p.page_size];
    if (page < 0 || page >= p.num_pages) page = 0;  // never read outside the pool
    return ((page * p.page_size + key_pos % p.page_size) * p.kv_heads + h) * d;
  };
  std::vector<float> maxes(group, -INFINITY);
  for (int64_t i = 0; i < n; ++i) {
    const float* key = p.k + slot_offset(first + i);
    for (int64_t g = 0; g < group; ++g) {
      float s = Dot(q + g * d, key, d) * p.scale;
      if (p.softcap > 0.f) s = std::tanh(s / p.softcap) * p.softcap;
      scores[g * n + i] = s;
      maxes[g] = std::max(maxes[g], s);
    }
  }
  std::vector<float> denom(group, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * n;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - maxes[g]);
      denom[g] += s[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* value = p.v + slot_offset(first + i);
    for (int64_t g = 0; g < group; ++g) Axpy(scores[g * n + i], value, out + g * d, d);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / denom[g];
    for (int64_t j = 0; j < d; ++j) out[g * d + j] *= inv;
  }
}

void AttendRange(const Problem& p, int64_t begin, int64_t end) {
  std::vector<float> scores;
  for (int64_t item = begin; item < end; ++item) {
    AttendOne(p, item / p.kv_heads, item % p.kv_heads, scores);
  }
}

// Work is cut into chunks claimed through an atomic counter by the calling
// thread and by helpers scheduled on the pool. The caller only waits for
// chunks some running thread has claimed, so a busy pool can delay but never
// deadlock the call; helpers that start late find nothing left and return.
struct SharedWork {
  Problem problem;
  int64_t items = 0, chunk_items = 0, num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (;;) {
      const int64_t c = next.fetch_add(1);
      if (c >= num_chunks) return;
      const int64_t begin = c * chunk_items;
      AttendRange(problem, begin, std::min(items, begin + chunk_items));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Writes each row's new key and value into its cache slot. The caches are
// aliased to the results (the jitted caller donates them), so this updates
// them in place; XLA copies first where it cannot alias.
void WriteKV(const ffi::Buffer<ffi::F32>& k_new, const ffi::Buffer<ffi::F32>& v_new,
             const ffi::Buffer<ffi::S32>& slots, const ffi::Buffer<ffi::F32>& k_in,
             const ffi::Buffer<ffi::F32>& v_in, float* k_out, float* v_out) {
  const int64_t cache_elems = static_cast<int64_t>(k_in.element_count());
  if (k_out != k_in.typed_data()) std::memcpy(k_out, k_in.typed_data(), 4 * cache_elems);
  if (v_out != v_in.typed_data()) std::memcpy(v_out, v_in.typed_data(), 4 * cache_elems);
  const auto nd = k_new.dimensions();
  const int64_t row = nd[1] * nd[2];  // kv_heads * head_dim
  const int64_t num_slots = cache_elems / row;
  for (int64_t t = 0; t < nd[0]; ++t) {
    const int64_t slot = slots.typed_data()[t];
    if (slot < 0 || slot >= num_slots) continue;
    std::memcpy(k_out + slot * row, k_new.typed_data() + t * row, 4 * row);
    std::memcpy(v_out + slot * row, v_new.typed_data() + t * row, 4 * row);
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                              ffi::Buffer<ffi::S32> slot_mapping,
                              ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                              ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> token_req,
                              ffi::Buffer<ffi::S32> page_tables,
                              ffi::Buffer<ffi::S32> num_tokens, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> k_out,
                              ffi::ResultBuffer<ffi::F32> v_out, float scale,
                              int64_t sliding_window, int64_t chunk_size, float softcap) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = page_tables.dimensions();
  const auto nd = k_new.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || nd.size() != 3) {
    return ffi::Error::InvalidArgument("paged attention: unexpected ranks");
  }
  if (kd[3] != qd[2] || qd[1] % kd[2] != 0 || nd[0] != qd[0] || nd[1] != kd[2] ||
      nd[2] != kd[3] || slot_mapping.element_count() != static_cast<size_t>(qd[0])) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not match");
  }
  WriteKV(k_new, v_new, slot_mapping, k_cache, v_cache, k_out->typed_data(),
          v_out->typed_data());
  auto work = std::make_shared<SharedWork>();
  Problem& p = work->problem;
  p.q = q.typed_data();
  p.k = k_out->typed_data();
  p.v = v_out->typed_data();
  p.positions = positions.typed_data();
  p.token_req = token_req.typed_data();
  p.tables = page_tables.typed_data();
  p.out = out->typed_data();
  p.heads = qd[1];
  p.dim = qd[2];
  p.num_pages = kd[0];
  p.page_size = kd[1];
  p.kv_heads = kd[2];
  p.max_pages = td[1];
  p.num_tokens = std::min<int64_t>(num_tokens.typed_data()[0], qd[0]);
  p.window = sliding_window;
  p.chunk = chunk_size;
  p.scale = scale;
  p.softcap = softcap;
  const int64_t rows = qd[0];
  // Rows past num_tokens only need zeroing; they are cheap, so chunks are cut
  // over the real rows' items and the padding is cleared here at once.
  const int64_t real_items = p.num_tokens * p.kv_heads;
  std::memset(p.out + p.num_tokens * p.heads * p.dim, 0,
              sizeof(float) * (rows - p.num_tokens) * p.heads * p.dim);
  work->items = real_items;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t wanted = std::min<int64_t>(real_items, threads * 4);
  work->num_chunks = std::max<int64_t>(1, wanted);
  work->chunk_items = (real_items + work->num_chunks - 1) / work->num_chunks;
  if (work->chunk_items == 0) return ffi::Error::Success();
  work->num_chunks = (real_items + work->chunk_items - 1) / work->chunk_items;
  for (int64_t i = 1; i < std::min(threads, work->num_chunks); ++i) {
    pool.Schedule([work] { work->Drain(); });
  }
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->num_chunks) {
    std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_req
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k_cache, aliased
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v_cache, aliased
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("chunk_size")
                                  .Attr<float>("softcap"));
