"""Paged attention over a flattened token batch: the pure-JAX path and the dispatch.

Layers call `write_and_attend`, which picks the implementation
(`AttentionBackend`): on XLA:CPU with a float32 or bfloat16 cache, the C++
kernel of
`esurge.models.cpu_kernels` (it writes the step's keys and values in place
and reads each visible key once from the pages); elsewhere (GPU/TPU,
bfloat16, no compiler) `write_kv` followed by the pure-JAX `paged_attention`
below. Both compute the same thing; the rest of this docstring describes the
pure-JAX formulation.

One call serves every row kind at once (prefill chunks, single-token decodes,
k-token speculative verification): each token knows its request and position,
reads its request's pages through the request's page table, and is masked by
position (causal, sliding window, chunked local). Keys and values are written
into the cache before attention, so a token sees the keys of its own step.

The formulation is memory-bounded: an online-softmax loop walks the page
table in blocks of `block_pages` pages; per step each token gathers only that
block of its request's keys and values ([T, block_pages * page_size, ...]).
By default the block shrinks for large token buckets so one gathered block
stays under `GATHER_BUDGET_BYTES`.
The loop covers just the blocks any real token can see (up to the furthest
position, from the earliest window start), so short contexts and sliding
windows cost less. `write_and_attend` is also the boundary a Pallas kernel
can later take on GPU/TPU.

Masked scores use a large finite negative and masked probabilities are
zeroed explicitly, so a token that sees nothing (padding) yields zeros, never
NaN, and nothing it writes can poison the null page.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax import lax

from esurge.models.cpu_kernels import attention_kernel_serves, paged_attention_kernel
from esurge.models.local_shards import over_local_heads
from esurge.models.rope import apply_rope

__all__ = [
    "GATHER_BUDGET_BYTES", "MAX_BLOCK_PAGES", "AttentionBackend", "AttentionMetadata",
    "block_pages_for", "kernel_serves", "paged_attention", "write_and_attend", "write_kv",
]

MAX_BLOCK_PAGES = 4  # 4 pages of keys per token stay cache-resident on CPU; 8 ran ~10% slower
GATHER_BUDGET_BYTES = 64 * 1024 * 1024
_MASKED = -1e30


class AttentionBackend(enum.Enum):
    """Which implementation computes paged attention."""

    AUTO = "auto"  # the CPU kernel where it applies (XLA:CPU, its cache dtype, built), else XLA
    XLA = "xla"  # the pure-JAX formulation below, on any platform
    CPU_KERNEL = "cpu_kernel"  # esurge/models/cpu_kernels; ValueError where it cannot run


def kernel_serves(dtype: jnp.dtype | str) -> bool:
    """True when AUTO attention over a cache of this dtype runs in the CPU kernel
    (callers then skip what only helps the XLA path, such as query tiles)."""
    return attention_kernel_serves(dtype)


def _use_kernel(backend: AttentionBackend, q: jax.Array, k_cache: jax.Array,
                v_cache: jax.Array) -> bool:
    if backend is AttentionBackend.XLA:
        return False
    fits = (k_cache.dtype == v_cache.dtype and q.dtype in (jnp.float32, k_cache.dtype)
            and kernel_serves(k_cache.dtype))
    if backend is AttentionBackend.CPU_KERNEL and not fits:
        raise ValueError("the CPU paged-attention kernel needs the CPU platform, a float32 "
                         "or bfloat16 cache, and a C++ compiler to build it")
    return fits


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """What one cache group's attention needs to know about the step.

    positions: each token's position in its sequence.
    token_req: each token's request row.
    page_tables: this group's page ids per request, logical page j holding
        positions [j * page_size, (j + 1) * page_size).
    num_tokens: real tokens; the rest of the T rows are padding.
    query_tile: rows come in aligned tiles of this many rows that each belong
        to one request; attention then gathers keys once per tile rather than
        once per row (a prefill chunk of n tokens costs n / tile gathers).
        1 means no such promise.
    tile_rows / row_in_tiles: when given, the flat rows are regrouped into
        tiles by tile_rows before attention (a request's last tile is filled
        with copies of its last row) and the result is brought back by
        row_in_tiles, so callers keep the flat layout.
    """

    positions: jax.Array  # [T] int32
    token_req: jax.Array  # [T] int32
    page_tables: jax.Array  # [R, P] int32
    num_tokens: jax.Array  # [] int32
    query_tile: int = field(default=1, metadata={"static": True})
    tile_rows: jax.Array | None = None  # [T_tiled] int32: flat row of each tiled row
    row_in_tiles: jax.Array | None = None  # [T] int32: tiled row of each flat row


def write_kv(
    k_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim]
    v: jax.Array,  # [T, kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32: page_id * page_size + offset
) -> tuple[jax.Array, jax.Array]:
    """Scatter each token's key and value into its slot."""
    shape = k_cache.shape
    flat = (shape[0] * shape[1], *shape[2:])
    k_new = k_cache.reshape(flat).at[slot_mapping].set(k.astype(k_cache.dtype))
    v_new = v_cache.reshape(flat).at[slot_mapping].set(v.astype(v_cache.dtype))
    return k_new.reshape(shape), v_new.reshape(shape)


def _first_visible(
    positions: jax.Array,  # [T]
    sliding_window: int | None,
    chunk_size: int | None,
) -> jax.Array:  # [T]
    first = jnp.zeros_like(positions)
    if sliding_window is not None:
        first = jnp.maximum(first, positions - sliding_window + 1)
    if chunk_size is not None:
        first = jnp.maximum(first, (positions // chunk_size) * chunk_size)
    return first


def _visible(
    key_pos: jax.Array,  # [B]
    positions: jax.Array,  # [T]
    sliding_window: int | None,
    chunk_size: int | None,
) -> jax.Array:  # [T, B] bool
    q = positions[:, None]
    k = key_pos[None, :]
    mask = k <= q
    if sliding_window is not None:
        mask &= k > q - sliding_window
    if chunk_size is not None:
        mask &= (k // chunk_size) == (q // chunk_size)
    return mask


def _block_range(
    metadata: AttentionMetadata, block_tokens: int, num_blocks: int,
    sliding_window: int | None, chunk_size: int | None,
) -> tuple[jax.Array, jax.Array]:
    """[start, end) of the page blocks any real token can see."""
    pos = metadata.positions
    real = jnp.arange(pos.shape[0]) < metadata.num_tokens
    end = jnp.max(jnp.where(real, pos, 0)) // block_tokens + 1
    first = _first_visible(pos, sliding_window, chunk_size)
    start = jnp.min(jnp.where(real, first, num_blocks * block_tokens)) // block_tokens
    end = jnp.minimum(end, num_blocks)
    return jnp.minimum(start, end), end


Carry = tuple[jax.Array, jax.Array, jax.Array]  # running max, denominator, weighted sum


def _fold(carry: Carry, s: jax.Array, visible: jax.Array, softcap: float | None,
          weigh: Callable[[jax.Array], jax.Array]) -> Carry:
    """Fold one block of scores s [..., B] into the running softmax statistics.

    weigh(p) -> the block's probability-weighted values [..., D].
    """
    m, denom, acc = carry
    if softcap is not None:
        s = jnp.tanh(s / softcap) * softcap
    s = jnp.where(visible, s, _MASKED)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    return m_new, denom * alpha + p.sum(axis=-1), acc * alpha[..., None] + weigh(p)


def _run_blocks(step: Callable[[jax.Array, Carry], Carry], stats_shape: tuple[int, ...],
                head_dim: int, start: jax.Array, end: jax.Array) -> jax.Array:
    """Run step over page blocks [start, end); the normalised output [*stats_shape, D]."""
    init = (jnp.full(stats_shape, _MASKED, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, head_dim), jnp.float32))
    _, denom, acc = lax.fori_loop(start, end, step, init)
    return acc / jnp.where(denom > 0, denom, 1.0)[..., None]


def block_pages_for(num_tokens: int, k_cache_shape: tuple[int, ...], itemsize: int) -> int:
    """Pages per block: up to MAX_BLOCK_PAGES, fewer when one block of K for all tokens
    would exceed GATHER_BUDGET_BYTES."""
    _, page_size, kv_heads, head_dim = k_cache_shape
    per_page = num_tokens * page_size * kv_heads * head_dim * itemsize
    return max(1, min(MAX_BLOCK_PAGES, GATHER_BUDGET_BYTES // max(per_page, 1)))


def paged_attention(
    q: jax.Array,  # [T, num_heads, head_dim]
    k_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    block_pages: int | None = None,
) -> jax.Array:  # [T, num_heads, head_dim]
    """Causal attention of each token over its request's paged keys and values (XLA).

    block_pages: pages per online-softmax step; None picks block_pages_for.
    """
    rows, back = metadata.tile_rows, metadata.row_in_tiles
    if rows is not None and back is not None:  # regroup into tiles, attend, then bring back
        tiled = AttentionMetadata(metadata.positions[rows], metadata.token_req[rows],
                                  metadata.page_tables, jnp.int32(rows.shape[0]),
                                  query_tile=metadata.query_tile)
        return paged_attention(q[rows], k_cache, v_cache, tiled, scale=scale,
                               sliding_window=sliding_window, chunk_size=chunk_size,
                               softcap=softcap, block_pages=block_pages)[back]
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    tile = metadata.query_tile
    if tile < 1 or num_tokens % tile:
        raise ValueError(f"query_tile {tile} must be >= 1 and divide the {num_tokens} rows")
    if block_pages is None:
        block_pages = block_pages_for(num_tokens // tile, k_cache.shape, k_cache.dtype.itemsize)
    if block_pages < 1:
        raise ValueError(f"block_pages must be >= 1, got {block_pages}")
    max_pages = metadata.page_tables.shape[1]
    block_pages = min(block_pages, max_pages)
    num_blocks = -(-max_pages // block_pages)
    tables = jnp.pad(metadata.page_tables, ((0, 0), (0, num_blocks * block_pages - max_pages)))
    block_tokens = block_pages * page_size
    start, end = _block_range(metadata, block_tokens, num_blocks, sliding_window, chunk_size)
    blocks = _Blocks(tables, block_pages, block_tokens, start, end)
    attend = _attend_rows if tile == 1 else _attend_tiles
    out = attend(q, k_cache, v_cache, metadata, blocks, scale, sliding_window, chunk_size,
                 softcap)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def write_and_attend(
    q: jax.Array,  # [T, num_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim]: this step's keys
    v: jax.Array,  # [T, kv_heads, head_dim]: this step's values
    k_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    v_cache: jax.Array,  # [num_pages, page_size, kv_heads, head_dim]
    slot_mapping: jax.Array,  # [T] int32
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    block_pages: int | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,  # cos, sin [T, head_dim]
    backend: AttentionBackend = AttentionBackend.AUTO,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [T, num_heads, head_dim], k_cache, v_cache
    """(apply_rope to q and k,) write_kv, then paged_attention, by the backend
    chosen (see AttentionBackend); the kernel rotates on the fly.

    block_pages tunes the XLA path only (the kernel walks 16-key blocks).
    Rows past metadata.num_tokens are padding: their output is unspecified.
    """
    if _use_kernel(backend, q, k_cache, v_cache):
        # The kernel walks the flat rows; tiles only help the XLA formulation.
        def kernel(q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array,
                   k_cache: jax.Array, v_cache: jax.Array, *replicated: jax.Array
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
            positions, token_req, page_tables, num_tokens, *cos_sin = replicated
            out, k_cache, v_cache = paged_attention_kernel(
                q, k, v, slots, k_cache, v_cache, positions, token_req, page_tables,
                num_tokens, scale=scale, sliding_window=sliding_window, chunk_size=chunk_size,
                softcap=softcap, rope=(cos_sin[0], cos_sin[1]) if cos_sin else None)
            return out.astype(q.dtype), k_cache, v_cache

        replicated = (metadata.positions, metadata.token_req, metadata.page_tables,
                      metadata.num_tokens, *(rope or ()))
        return over_local_heads(kernel, len(replicated))(q, k, v, slot_mapping, k_cache,
                                                         v_cache, *replicated)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, slot_mapping)
    out = paged_attention(q, k_cache, v_cache, metadata, scale=scale,
                          sliding_window=sliding_window, chunk_size=chunk_size,
                          softcap=softcap, block_pages=block_pages)
    return out, k_cache, v_cache


@dataclass(frozen=True)
class _Blocks:
    """The page blocks one attention call walks."""

    tables: jax.Array  # [R, num_blocks * block_pages] int32, padded page tables
    block_pages: int
    block_tokens: int
    start: jax.Array  # [] first block any real row can see
    end: jax.Array  # [] one past the last such block

    def pages(self, block: jax.Array, req: jax.Array) -> jax.Array:  # [len(req), block_pages]
        return lax.dynamic_slice_in_dim(self.tables, block * self.block_pages, self.block_pages,
                                        axis=1)[req]

    def key_positions(self, block: jax.Array) -> jax.Array:  # [block_tokens]
        return block * self.block_tokens + jnp.arange(self.block_tokens)


def _attend_rows(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                 metadata: AttentionMetadata, blocks: _Blocks, scale: float,
                 sliding_window: int | None, chunk_size: int | None,
                 softcap: float | None) -> jax.Array:  # [T, kv, g, D]
    """Every row gathers its own request's pages: the cheapest form for decode rows
    (one per request), where einsums over [T, kv] beat a reshaped batched matmul."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    qg = q.reshape(num_tokens, kv_heads, group, head_dim)

    def gather(cache: jax.Array, pages: jax.Array) -> jax.Array:  # -> [T, B, kv, D]
        return cache[pages].reshape(num_tokens, blocks.block_tokens, kv_heads, head_dim)

    def step(block: jax.Array, carry: Carry) -> Carry:
        pages = blocks.pages(block, metadata.token_req)
        k, v = gather(k_cache, pages), gather(v_cache, pages)
        mask = _visible(blocks.key_positions(block), metadata.positions, sliding_window,
                        chunk_size)
        s = jnp.einsum("tkgd,tbkd->tkgb", qg, k, preferred_element_type=jnp.float32) * scale
        return _fold(carry, s, mask[:, None, None], softcap,
                     lambda p: jnp.einsum("tkgb,tbkd->tkgd", p.astype(v.dtype), v,
                                          preferred_element_type=jnp.float32))

    return _run_blocks(step, (num_tokens, kv_heads, group), head_dim, blocks.start, blocks.end)


def _attend_tiles(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                  metadata: AttentionMetadata, blocks: _Blocks, scale: float,
                  sliding_window: int | None, chunk_size: int | None,
                  softcap: float | None) -> jax.Array:  # [T, kv, g, D]
    """Rows come in tiles of one request: each tile gathers its pages once and
    runs one matmul batch per (tile, kv head)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group, tile = num_heads // kv_heads, metadata.query_tile
    tiles, width = num_tokens // tile, blocks.block_tokens
    tile_req = metadata.token_req.reshape(tiles, tile)[:, 0]  # [N]
    qt = q.reshape(tiles, tile, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(tiles * kv_heads, tile * group, head_dim)

    def gather(cache: jax.Array, pages: jax.Array) -> jax.Array:  # -> [N * kv, B, D]
        block = cache[pages].reshape(tiles, width, kv_heads, head_dim)
        return block.transpose(0, 2, 1, 3).reshape(tiles * kv_heads, width, head_dim)

    def step(block: jax.Array, carry: Carry) -> Carry:
        pages = blocks.pages(block, tile_req)
        k, v = gather(k_cache, pages), gather(v_cache, pages)
        mask = _visible(blocks.key_positions(block), metadata.positions, sliding_window,
                        chunk_size).reshape(tiles, tile, width)
        s = lax.dot_general(qt, k, (((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)
        s = s.reshape(tiles, kv_heads, tile, group, width) * scale

        def weigh(p: jax.Array) -> jax.Array:
            pv = lax.dot_general(p.astype(v.dtype).reshape(tiles * kv_heads, tile * group, width),
                                 v, (((2,), (1,)), ((0,), (0,))),
                                 preferred_element_type=jnp.float32)
            return pv.reshape(tiles, kv_heads, tile, group, head_dim)

        return _fold(carry, s, mask[:, None, :, None, :], softcap, weigh)

    out = _run_blocks(step, (tiles, kv_heads, tile, group), head_dim, blocks.start, blocks.end)
    return out.transpose(0, 2, 1, 3, 4)  # [N, tile, kv, g, D]
