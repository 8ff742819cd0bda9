"""paged_attention against dense attention, for every mask kind, soft-capping and block size."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esurge.models import AttentionMetadata, paged_attention, write_kv
from esurge.models.paged_attention import block_pages_for

PAGE, NUM_PAGES, MAX_PAGES, HEADS, KV_HEADS, DIM = 4, 40, 6, 4, 2, 8
# (context length after the step, tokens computed this step) per request
REQUESTS = ((13, 4), (7, 1), (20, 20))
T = 32


def dense_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int, window: int | None,
                    chunk: int | None, softcap: float | None) -> np.ndarray:
    """One token's attention over a request's dense keys [len, kv_heads, dim]."""
    keys = np.arange(k.shape[0])
    visible = keys <= pos
    if window is not None:
        visible &= keys > pos - window
    if chunk is not None:
        visible &= keys // chunk == pos // chunk
    rep = HEADS // KV_HEADS
    k_full, v_full = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # [len, heads, dim]
    scores = np.einsum("hd,lhd->hl", q, k_full) * DIM ** -0.5
    if softcap is not None:
        scores = np.tanh(scores / softcap) * softcap
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hl,lhd->hd", probs, v_full)


def build_case(seed: int) -> tuple[dict[str, Any], list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    tables = np.zeros((len(REQUESTS), MAX_PAGES), np.int32)
    keys, values = [], []
    positions, token_req = np.zeros(T, np.int32), np.zeros(T, np.int32)
    row = 0
    for r, (length, new) in enumerate(REQUESTS):
        for j in range(-(-length // PAGE)):
            tables[r, j] = free.pop()
        keys.append(rng.standard_normal((length, KV_HEADS, DIM)).astype(np.float32))
        values.append(rng.standard_normal((length, KV_HEADS, DIM)).astype(np.float32))
        positions[row:row + new] = np.arange(length - new, length)
        token_req[row:row + new] = r
        row += new
    arrays = {"tables": tables, "positions": positions, "token_req": token_req,
              "num_tokens": np.int32(row), "q": rng.standard_normal((T, HEADS, DIM)).astype(
                  np.float32)}
    return arrays, keys, values


def fill_cache(case: dict[str, Any], keys: list[np.ndarray], values: list[np.ndarray]
               ) -> tuple[jax.Array, jax.Array]:
    k_cache = jnp.full((NUM_PAGES, PAGE, KV_HEADS, DIM), 7.0)  # garbage where nothing lives
    v_cache = jnp.full((NUM_PAGES, PAGE, KV_HEADS, DIM), -7.0)
    for r, (k, v) in enumerate(zip(keys, values, strict=True)):
        pos = np.arange(k.shape[0])
        slots = case["tables"][r][pos // PAGE] * PAGE + pos % PAGE
        k_cache, v_cache = write_kv(k_cache, v_cache, jnp.asarray(k), jnp.asarray(v),
                                    jnp.asarray(slots))
    return k_cache, v_cache


@pytest.mark.parametrize(("window", "chunk", "softcap", "block_pages"), [
    (None, None, None, 8),
    (5, None, None, 1),
    (None, 6, None, 4),
    (None, None, 1.5, 3),
    (9, None, 2.0, 2),
])
def test_matches_dense_attention(window: int | None, chunk: int | None, softcap: float | None,
                                 block_pages: int) -> None:
    case, keys, values = build_case(seed=block_pages)
    k_cache, v_cache = fill_cache(case, keys, values)
    metadata = AttentionMetadata(jnp.asarray(case["positions"]), jnp.asarray(case["token_req"]),
                                 jnp.asarray(case["tables"]), jnp.asarray(case["num_tokens"]))
    attend = jax.jit(functools.partial(
        paged_attention, scale=DIM ** -0.5, sliding_window=window, chunk_size=chunk,
        softcap=softcap, block_pages=block_pages))
    out = np.asarray(attend(jnp.asarray(case["q"]), k_cache, v_cache, metadata))
    for t in range(int(case["num_tokens"])):
        r, pos = case["token_req"][t], case["positions"][t]
        want = dense_reference(case["q"][t], keys[r], values[r], pos, window, chunk, softcap)
        np.testing.assert_allclose(out[t], want, atol=2e-5, err_msg=f"token {t}")
    assert np.all(np.isfinite(out))  # padding rows included


def test_write_kv_fills_exactly_the_mapped_slots() -> None:
    k_cache = jnp.zeros((3, 2, 1, 2))
    k = jnp.arange(6.0).reshape(3, 1, 2) + 1
    new_k, new_v = write_kv(k_cache, k_cache, k, -k, jnp.asarray([5, 0, 2]))
    flat = np.asarray(new_k).reshape(6, 2)
    np.testing.assert_array_equal(flat, [[3, 4], [0, 0], [5, 6], [0, 0], [0, 0], [1, 2]])
    np.testing.assert_array_equal(np.asarray(new_v), -np.asarray(new_k))


def test_mismatched_heads_are_refused() -> None:
    metadata = AttentionMetadata(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32),
                                 jnp.zeros((1, 2), jnp.int32), jnp.int32(2))
    cache = jnp.zeros((4, PAGE, 3, DIM))
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of kv_heads \(3\)"):
        paged_attention(jnp.zeros((2, 4, DIM)), cache, cache, metadata, scale=1.0)


@pytest.mark.parametrize(("num_tokens", "expected"), [(16, 4), (256, 4), (512, 4), (1024, 2),
                                                      (4096, 1)])
def test_block_size_shrinks_for_large_token_buckets(num_tokens: int, expected: int) -> None:
    # One page of bf16 K for 16 tokens x 8 heads x 128 dims is 32 KiB per query token.
    assert block_pages_for(num_tokens, (100, 16, 8, 128), itemsize=2) == expected


def tile_case(case: dict[str, Any], tile: int) -> tuple[dict[str, Any], list[int]]:
    """The case laid out with each request's rows starting on a tile boundary.

    Filler rows inside a request's last tile repeat its last real row; returns
    the new layout and, per original row, its new row index.
    """
    rows: list[int] = []  # original row feeding each new row
    where: list[int] = []
    for r in range(len(REQUESTS)):
        mine = [t for t in range(int(case["num_tokens"])) if case["token_req"][t] == r]
        start = len(rows)
        rows.extend(mine)
        where.extend(range(start, start + len(mine)))
        rows.extend([mine[-1]] * (-len(mine) % tile))
    rows.extend([rows[-1]] * (-len(rows) % tile))
    idx = np.asarray(rows)
    tiled = dict(case, positions=case["positions"][idx], token_req=case["token_req"][idx],
                 q=case["q"][idx], num_tokens=np.int32(len(rows)))
    return tiled, where


@pytest.mark.parametrize(("tile", "window", "softcap"), [(4, None, None), (8, 5, None),
                                                          (16, None, 1.5)])
def test_query_tiles_match_dense_attention(tile: int, window: int | None,
                                           softcap: float | None) -> None:
    case, keys, values = build_case(seed=tile)
    k_cache, v_cache = fill_cache(case, keys, values)
    tiled, where = tile_case(case, tile)
    metadata = AttentionMetadata(jnp.asarray(tiled["positions"]), jnp.asarray(tiled["token_req"]),
                                 jnp.asarray(tiled["tables"]), jnp.asarray(tiled["num_tokens"]),
                                 query_tile=tile)
    attend = jax.jit(functools.partial(paged_attention, scale=DIM ** -0.5, sliding_window=window,
                                       softcap=softcap, block_pages=2))
    out = np.asarray(attend(jnp.asarray(tiled["q"]), k_cache, v_cache, metadata))
    for t in range(int(case["num_tokens"])):
        r, pos = case["token_req"][t], case["positions"][t]
        want = dense_reference(case["q"][t], keys[r], values[r], pos, window, None, softcap)
        np.testing.assert_allclose(out[where[t]], want, atol=2e-5, err_msg=f"token {t}")
