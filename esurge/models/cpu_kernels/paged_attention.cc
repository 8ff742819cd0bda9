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
// RoPE is fused in when `rotate` is set: q and the new k arrive unrotated with
// cos/sin tables [T, head_dim], and are rotated on the way into the query
// scratch and the cache (as a separate XLA pass over q and k, the rotation cost
// a decode step ~9% of its time).
//
// The cache is float32 (EsurgePagedAttention) or bfloat16
// (EsurgePagedAttentionBf16): a bfloat16 cache stores each new key and value
// rounded to nearest even, and each key block is widened to float32 as it is
// read; queries, scores, softmax and the output stay float32.
//
// Attribute encoding at this boundary: sliding_window, chunk_size and softcap
// are 0 when the layer has none (the Python wrapper maps None to 0).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace esurge_attention;  // NOLINT: the kernel's own arithmetic

// d bfloat16 values widened to float32 into out (exact); returns out.
const float* Widen(const uint16_t* in, int64_t d, float* out) {
  for (int64_t e = 0; e < d; ++e) {
    const uint32_t bits = static_cast<uint32_t>(in[e]) << 16;
    std::memcpy(out + e, &bits, sizeof(float));
  }
  return out;
}

// A float32 rounded to bfloat16, to nearest even (NaN stays NaN).
inline uint16_t RoundBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Cache element stores: float32 as is, bfloat16 rounded.
inline void StoreRow(const float* in, int64_t n, float* out) { std::memcpy(out, in, 4 * n); }
inline void StoreRow(const float* in, int64_t n, uint16_t* out) {
  for (int64_t e = 0; e < n; ++e) out[e] = RoundBf16(in[e]);
}

// Element offsets into the caches of keys [from, from + n) of kv head 0 (head
// h is h * dim further): one division per block, then a walk along the page
// table (a division per key cost as much as the decode arithmetic itself).
// Pages outside the pool read page 0, never memory outside it.
void SlotOffsets(const Problem& p, const int32_t* table, int64_t from, int64_t n,
                 int64_t* out) {
  auto valid = [&](int64_t page) { return page < 0 || page >= p.num_pages ? 0 : page; };
  int64_t index = from / p.page_size, offset = from - index * p.page_size;
  int64_t page = valid(table[index]);
  for (int64_t j = 0; j < n; ++j) {
    out[j] = (page * p.page_size + offset) * p.kv_heads * p.dim;
    if (++offset == p.page_size && j + 1 < n) {
      offset = 0;
      page = valid(table[++index]);
    }
  }
}

// The key range [first, last] each row of [r0, r0 + rows) sees (last < first:
// none), and the union's bounds kmin, kmax.
void VisibleKeys(const Problem& p, int64_t r0, int64_t rows, int64_t* first, int64_t* last,
                 int64_t& kmin, int64_t& kmax) {
  kmin = INT64_MAX, kmax = -1;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t pos = p.positions[r0 + i];
    first[i] = 0;
    if (p.window > 0) first[i] = std::max(first[i], pos - p.window + 1);
    if (p.chunk > 0) first[i] = std::max(first[i], (pos / p.chunk) * p.chunk);
    last[i] = std::min(pos, p.max_pages * p.page_size - 1);
    if (pos < 0 || last[i] < first[i] || r0 + i >= p.num_tokens) last[i] = -1, first[i] = 0;
    if (last[i] >= first[i]) kmin = std::min(kmin, first[i]), kmax = std::max(kmax, last[i]);
  }
}

// Query heads of kv heads [h0, h1) of rows [r0, r0 + rows), rotated when RoPE
// tables are given, into per-head lane blocks of `stride` lanes.
void StageQueries(const Problem& p, int64_t r0, int64_t rows, int64_t h0, int64_t h1,
                  int64_t stride, float* qs) {
  const int64_t group = p.heads / p.kv_heads, d = p.dim;
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t i = 0; i < rows; ++i) {
      const float* q = p.q + ((r0 + i) * p.heads + h * group) * d;
      float* staged = qs + ((h - h0) * stride + i * group) * d;
      if (p.cos == nullptr) {
        std::copy(q, q + group * d, staged);
        continue;
      }
      const float* cos = p.cos + (r0 + i) * d;
      const float* sin = p.sin + (r0 + i) * d;
      for (int64_t g = 0; g < group; ++g) Rotate(q + g * d, cos, sin, d, staged + g * d);
    }
  }
}

// The block's keys and values of kv heads [h0, h1), widened into w.kf / w.vf
// as [head, key, D]. Read in cache order (a key's heads are adjacent): one head
// at a time would stride the block by a whole slot per key, and those reads
// wait on memory where a forward walk streams (measured: the decode step's
// bfloat16 attention took as long as float32's over twice the bytes).
void WidenBlock(const Problem& p, const int64_t* slots, int64_t nk, const int64_t* next,
                int64_t next_nk, int64_t h0, int64_t h1, Scratch& w) {
  // Each widening load of a key waits on memory (a profile of the 150M model in
  // bfloat16 put three quarters of this function's time on the instruction
  // after it): while slot j's keys are widened, its values and the keys four
  // slots on are fetched (engine 795-804 -> 914-934 tok/s, alternating runs;
  // the values alone 838-875, with keys two slots on 847-862, eight 909). Four
  // slots on from a block's last four is in the next block (`next`, next_nk
  // slots): before, a quarter of the keys were never prefetched.
  const int64_t d = p.dim;
  const int64_t run_bytes = (h1 - h0) * d * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t j = 0; j < nk; ++j) {
    const char* values = reinterpret_cast<const char*>(p.v16 + slots[j] + h0 * d);
    for (int64_t off = 0; off < run_bytes; off += 64) __builtin_prefetch(values + off);
    const int64_t* ahead = j + 4 < nk ? slots + j + 4 : j + 4 - nk < next_nk ? next + j + 4 - nk
                                                                            : nullptr;
    if (ahead != nullptr) {
      const char* keys = reinterpret_cast<const char*>(p.k16 + *ahead + h0 * d);
      for (int64_t off = 0; off < run_bytes; off += 64) __builtin_prefetch(keys + off);
    }
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t at = ((h - h0) * kKeyBlock + j) * d;
      Widen(p.k16 + slots[j] + h * d, d, w.kf.data() + at);
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t at = ((h - h0) * kKeyBlock + j) * d;
      Widen(p.v16 + slots[j] + h * d, d, w.vf.data() + at);
    }
  }
}

// One query block (rows [r0, r1) of one request) and kv heads [h0, h1): each
// head's group of query heads, online softmax over key blocks. Heads share a
// key block's slots, and consecutive heads of a slot are adjacent in the cache,
// so taking them together reads the block as one run.
void AttendBlock(const Problem& p, int64_t r0, int64_t r1, int64_t h0, int64_t h1,
                 Scratch& w) {
  const int64_t group = p.heads / p.kv_heads, d = p.dim, rows = r1 - r0;
  const int32_t* table = p.tables + p.token_req[r0] * p.max_pages;
  int64_t first[kQueryBlock], last[kQueryBlock], kmin, kmax;
  VisibleKeys(p, r0, rows, first, last, kmin, kmax);
  const int64_t lanes = rows * group, heads = h1 - h0;
  const int64_t stride = (lanes + kMaxLaneTile - 1) / kMaxLaneTile * kMaxLaneTile;
  // kt is written whole before each use (only when transposing): no zeroing.
  w.kt.resize(static_cast<size_t>(d * kKeyBlock));
  if (p.k16 != nullptr) {
    w.kf.resize(static_cast<size_t>(heads * kKeyBlock * d));
    w.vf.resize(static_cast<size_t>(heads * kKeyBlock * d));
  }
  w.acc.assign(static_cast<size_t>(heads * stride * d), 0.f);
  w.m.assign(static_cast<size_t>(heads * stride), -INFINITY);
  w.l.assign(static_cast<size_t>(heads * stride), 0.f);
  w.qs.assign(static_cast<size_t>(heads * stride * d), 0.f);
  StageQueries(p, r0, rows, h0, h1, stride, w.qs.data());
  // Transposing a key block pays off only when several query heads reuse it
  // and a block's scores fill one vector (AVX-512); a lone decode row, and
  // every block without AVX-512, takes direct dot products instead (a 2-core
  // AVX2 EPYC, SmolLM2's model step with 2 / 5 / 16 rows of one request at
  // context 1024: 25.5-25.8 / 45.6-48.7 / 124-131 ms direct, 35.4-41.3 /
  // 68.1-70.8 / 186-187 ms transposed).
#if defined(__AVX512F__)
  const bool transpose = lanes >= 4;
#else
  const bool transpose = false;
#endif
  // No software prefetch of a whole next block's pages at once: measured slower
  // at both one and two threads (prefetches fill the line buffers the loads
  // need). A bfloat16 block's widening prefetches slot by slot, into the next
  // block's slots near its end, so each block's slots are found one block early.
  KeyBlock blk;
  int64_t offsets[2][kKeyBlock];
  int64_t* slots = offsets[0];
  int64_t* next = offsets[1];
  if (kmin <= kmax) {
    SlotOffsets(p, table, kmin, std::min<int64_t>(kKeyBlock, kmax - kmin + 1), slots);
  }
  for (int64_t kb = kmin; kb <= kmax; kb += kKeyBlock) {
    const int64_t nk = std::min<int64_t>(kKeyBlock, kmax - kb + 1);
    const int64_t next_nk = std::clamp<int64_t>(kmax - kb - kKeyBlock + 1, 0, kKeyBlock);
    if (next_nk > 0) SlotOffsets(p, table, kb + kKeyBlock, next_nk, next);
    blk.kb = kb;
    blk.nk = nk;
    if (p.k16 != nullptr) WidenBlock(p, slots, nk, next, next_nk, h0, h1, w);
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t j = 0; j < nk; ++j) {
        if (p.k16 != nullptr) {
          const int64_t at = ((h - h0) * kKeyBlock + j) * d;
          blk.keys[j] = w.kf.data() + at;
          blk.values[j] = w.vf.data() + at;
        } else {
          blk.keys[j] = p.k + slots[j] + h * d;
          blk.values[j] = p.v + slots[j] + h * d;
        }
      }
      for (int64_t j = 0; transpose && j < kKeyBlock; ++j) {
        for (int64_t e = 0; e < d; ++e) w.kt[e * kKeyBlock + j] = j < nk ? blk.keys[j][e] : 0.f;
      }
      const int64_t base = (h - h0) * stride;
      const Lanes view{w.kt.data(), w.qs.data() + base * d, w.acc.data() + base * d,
                       w.m.data() + base, w.l.data() + base};
      ForEachLaneTile(p, view, blk, first, last, rows, group, lanes, transpose);
    }
    std::swap(slots, next);
  }
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t lane = (h - h0) * stride + i * group + g;
        float* out = p.out + ((r0 + i) * p.heads + h * group + g) * d;
        const float inv = w.l[lane] > 0.f ? 1.f / w.l[lane] : 0.f;
        const float* acc = w.acc.data() + lane * d;
        for (int64_t e = 0; e < d; ++e) out[e] = acc[e] * inv;
      }
    }
  }
}

// Work items are (query block, run of heads_per_item kv heads) pairs.
void AttendRange(const Problem& p, const std::vector<int64_t>& starts, int64_t heads_per_item,
                 int64_t begin, int64_t end) {
  Scratch scratch;
  const int64_t runs = p.kv_heads / heads_per_item;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / runs, h0 = item % runs * heads_per_item;
    AttendBlock(p, starts[b], starts[b + 1], h0, h0 + heads_per_item, scratch);
  }
}

// Query blocks: runs of up to kQueryBlock consecutive real rows of one request.
std::vector<int64_t> QueryBlocks(const Problem& p) {
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (starts.empty() || t - starts.back() == kQueryBlock ||
        p.token_req[t] != p.token_req[starts.back()]) {
      starts.push_back(t);
    }
  }
  starts.push_back(p.num_tokens);
  return starts;
}

// Writes each row's new key (rotated when tables are given) and value into its
// cache slot. The caches are aliased to the results (the jitted caller donates
// them), so this updates them in place; XLA copies first where it cannot alias.
template <typename T>
void WriteKV(const ffi::Buffer<ffi::F32>& k_new, const ffi::Buffer<ffi::F32>& v_new,
             const ffi::Buffer<ffi::S32>& slots, const T* k_in, const T* v_in,
             int64_t cache_elems, const float* cos, const float* sin, T* k_out, T* v_out) {
  if (k_out != k_in) std::memcpy(k_out, k_in, sizeof(T) * cache_elems);
  if (v_out != v_in) std::memcpy(v_out, v_in, sizeof(T) * cache_elems);
  const auto nd = k_new.dimensions();
  const int64_t row = nd[1] * nd[2];  // kv_heads * head_dim
  const int64_t num_slots = cache_elems / row;
  std::vector<float> rotated(static_cast<size_t>(nd[2]));
  for (int64_t t = 0; t < nd[0]; ++t) {
    const int64_t slot = slots.typed_data()[t];
    if (slot < 0 || slot >= num_slots) continue;
    const float* k = k_new.typed_data() + t * row;
    if (cos == nullptr) {
      StoreRow(k, row, k_out + slot * row);
    } else {
      for (int64_t h = 0; h < nd[1]; ++h) {
        Rotate(k + h * nd[2], cos + t * nd[2], sin + t * nd[2], nd[2], rotated.data());
        StoreRow(rotated.data(), nd[2], k_out + slot * row + h * nd[2]);
      }
    }
    StoreRow(v_new.typed_data() + t * row, row, v_out + slot * row);
  }
}

// What one call needs besides the cache: the FFI arguments both cache types share.
struct Call {
  ffi::ThreadPool* pool;
  const ffi::Buffer<ffi::F32>* q;
  const ffi::Buffer<ffi::F32>* k_new;
  const ffi::Buffer<ffi::F32>* v_new;
  const ffi::Buffer<ffi::S32>* slot_mapping;
  const ffi::Buffer<ffi::S32>* positions;
  const ffi::Buffer<ffi::S32>* token_req;
  const ffi::Buffer<ffi::S32>* page_tables;
  const ffi::Buffer<ffi::S32>* num_tokens;
  const ffi::Buffer<ffi::F32>* cos;
  const ffi::Buffer<ffi::F32>* sin;
  float* out;
  float scale, softcap;
  int64_t sliding_window, chunk_size;
  bool rotate;
};

template <ffi::DataType D>
using CacheBuffer = ffi::Buffer<D>;

// The call over a cache of element type T (float or uint16_t bfloat16 bits).
template <typename T, ffi::DataType D>
ffi::Error Attend(const Call& c, const CacheBuffer<D>& k_cache, const CacheBuffer<D>& v_cache,
                  T* k_out, T* v_out) {
  const auto qd = c.q->dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = c.page_tables->dimensions();
  const auto nd = c.k_new->dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || nd.size() != 3) {
    return ffi::Error::InvalidArgument("paged attention: unexpected ranks");
  }
  if (kd[3] != qd[2] || qd[1] % kd[2] != 0 || nd[0] != qd[0] || nd[1] != kd[2] ||
      nd[2] != kd[3] || c.slot_mapping->element_count() != static_cast<size_t>(qd[0])) {
    return ffi::Error::InvalidArgument("paged attention: shapes do not match");
  }
  const size_t table = static_cast<size_t>(qd[0] * qd[2]);
  if (c.rotate &&
      (c.cos->element_count() != table || c.sin->element_count() != table || qd[2] % 2)) {
    return ffi::Error::InvalidArgument("paged attention: RoPE tables must be [T, head_dim]");
  }
  const float* cos_t = c.rotate ? c.cos->typed_data() : nullptr;
  const float* sin_t = c.rotate ? c.sin->typed_data() : nullptr;
  WriteKV<T>(*c.k_new, *c.v_new, *c.slot_mapping, reinterpret_cast<const T*>(k_cache.typed_data()),
             reinterpret_cast<const T*>(v_cache.typed_data()),
             static_cast<int64_t>(k_cache.element_count()), cos_t, sin_t, k_out, v_out);
  Problem p{};
  p.cos = cos_t;
  p.sin = sin_t;
  p.q = c.q->typed_data();
  if constexpr (std::is_same_v<T, float>) {
    p.k = k_out, p.v = v_out;
  } else {
    p.k16 = k_out, p.v16 = v_out;
  }
  p.positions = c.positions->typed_data();
  p.token_req = c.token_req->typed_data();
  p.tables = c.page_tables->typed_data();
  p.out = c.out;
  p.heads = qd[1];
  p.dim = qd[2];
  p.num_pages = kd[0];
  p.page_size = kd[1];
  p.kv_heads = kd[2];
  p.max_pages = td[1];
  p.num_tokens = std::min<int64_t>(c.num_tokens->typed_data()[0], qd[0]);
  p.window = c.sliding_window;
  p.chunk = c.chunk_size;
  p.scale = c.scale;
  p.softcap = c.softcap;
  const int64_t rows = qd[0];
  // Rows past num_tokens only need zeroing, done here at once; the work items
  // are (query block, kv heads) pairs over the real rows.
  const std::vector<int64_t> starts = QueryBlocks(p);
  const int64_t blocks = static_cast<int64_t>(starts.size() - 1);
  // All kv heads of a block in one item (one run through its slots) unless
  // that leaves threads idle, e.g. a lone long decode row.
  const int64_t heads_per_item = blocks >= 4 * c.pool->num_threads() ? p.kv_heads : 1;
  const int64_t items = blocks * (p.kv_heads / heads_per_item);
  std::memset(p.out + p.num_tokens * p.heads * p.dim, 0,
              sizeof(float) * (rows - p.num_tokens) * p.heads * p.dim);
  // Items differ in cost (later causal blocks see more keys): cut finely.
  esurge_kernels::ParallelFor(*c.pool, items, 16,
                              [&p, &starts, heads_per_item](int64_t begin, int64_t end) {
                                AttendRange(p, starts, heads_per_item, begin, end);
                              });
  return ffi::Error::Success();
}

template <ffi::DataType D>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                              ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<D> k_cache,
                              ffi::Buffer<D> v_cache, ffi::Buffer<ffi::S32> positions,
                              ffi::Buffer<ffi::S32> token_req, ffi::Buffer<ffi::S32> page_tables,
                              ffi::Buffer<ffi::S32> num_tokens, ffi::Buffer<ffi::F32> cos,
                              ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<D> k_out, ffi::ResultBuffer<D> v_out,
                              float scale, int64_t sliding_window, int64_t chunk_size,
                              float softcap, bool rotate) {
  const Call c{&pool, &q, &k_new, &v_new, &slot_mapping, &positions, &token_req, &page_tables,
               &num_tokens, &cos, &sin, out->typed_data(), scale, softcap, sliding_window,
               chunk_size, rotate};
  using T = std::conditional_t<D == ffi::DataType::F32, float, uint16_t>;
  return Attend<T, D>(c, k_cache, v_cache, reinterpret_cast<T*>(k_out->typed_data()),
                      reinterpret_cast<T*>(v_out->typed_data()));
}

template <ffi::DataType D>
auto Binding() {
  return ffi::Ffi::Bind()
      .template Ctx<ffi::ThreadPool>()
      .template Arg<ffi::Buffer<ffi::F32>>()  // q
      .template Arg<ffi::Buffer<ffi::F32>>()  // k_new
      .template Arg<ffi::Buffer<ffi::F32>>()  // v_new
      .template Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping
      .template Arg<ffi::Buffer<D>>()         // k_cache
      .template Arg<ffi::Buffer<D>>()         // v_cache
      .template Arg<ffi::Buffer<ffi::S32>>()  // positions
      .template Arg<ffi::Buffer<ffi::S32>>()  // token_req
      .template Arg<ffi::Buffer<ffi::S32>>()  // page_tables
      .template Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
      .template Arg<ffi::Buffer<ffi::F32>>()  // cos
      .template Arg<ffi::Buffer<ffi::F32>>()  // sin
      .template Ret<ffi::Buffer<ffi::F32>>()  // out
      .template Ret<ffi::Buffer<D>>()         // k_cache, aliased
      .template Ret<ffi::Buffer<D>>()         // v_cache, aliased
      .template Attr<float>("scale")
      .template Attr<int64_t>("sliding_window")
      .template Attr<int64_t>("chunk_size")
      .template Attr<float>("softcap")
      .template Attr<bool>("rotate");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgePagedAttention, PagedAttentionImpl<ffi::DataType::F32>,
                              Binding<ffi::DataType::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EsurgePagedAttentionBf16, PagedAttentionImpl<ffi::DataType::BF16>,
                              Binding<ffi::DataType::BF16>());
