"""The step input of the forward pass, and a host-side (numpy) builder for it.

A `ForwardBatch` flattens all requests of one step into T token rows:

- input_ids [T], positions [T]: the tokens computed this step and their
  positions in their sequences;
- token_req [T]: each token's request row;
- slot_mapping [G, T]: per cache group, where each token's K/V goes
  (page_id * page_size + offset); padding tokens point into the null page 0;
- page_tables [G, R, P]: per group, each request's page ids in logical order
  (page j holds positions [j * page_size, (j + 1) * page_size)); unused or
  freed entries are 0;
- query_start_loc [R + 1]: request r owns token rows
  [query_start_loc[r], query_start_loc[r + 1]); padded requests repeat the
  last value, so query_start_loc[R] is the number of real tokens;
- seq_lens [R]: each request's context length after this step;
- logits_indices [L]: the token rows whose logits are wanted (padded with 0).

Every shape is static per (T, R) bucket (with G, P and L fixed by the runner),
so steps of one bucket never recompile. Requests own consecutive token rows,
in request order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from esurge.models.kv_cache import NULL_PAGE

__all__ = ["BatchArray", "ForwardBatch", "RequestChunk", "build_forward_batch"]

# Built on the host as numpy, traced as jax arrays inside the jitted forward.
BatchArray = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardBatch:
    """One step's inputs; see the module docstring for the meaning of each array."""

    input_ids: BatchArray  # [T] int32
    positions: BatchArray  # [T] int32
    token_req: BatchArray  # [T] int32
    slot_mapping: BatchArray  # [G, T] int32
    page_tables: BatchArray  # [G, R, P] int32
    query_start_loc: BatchArray  # [R + 1] int32
    seq_lens: BatchArray  # [R] int32
    logits_indices: BatchArray  # [L] int32
    # Attention regroups rows into tiles of query_tile rows of one request
    # (see AttentionMetadata and tile_layout); static, so each value compiles once.
    query_tile: int = field(default=1, metadata={"static": True})
    tile_rows: BatchArray | None = None  # [T_tiled] int32
    row_in_tiles: BatchArray | None = None  # [T] int32

    @property
    def num_tokens(self) -> BatchArray:
        """Real (non-padding) token rows, as a scalar array."""
        return self.query_start_loc[-1]


@dataclass(frozen=True, slots=True)
class RequestChunk:
    """One request's share of a step.

    token_ids: the tokens computed this step (a prefill chunk, one decode
        token, or the last token plus k speculative tokens).
    start_position: the position of token_ids[0] (tokens already in the cache).
    page_tables: one page-id list per cache group, in logical order.
    num_logits: logits wanted for the last num_logits tokens (0 for a
        prefill chunk that does not end the prompt, 1 + k when verifying k).
    """

    token_ids: Sequence[int]
    start_position: int
    page_tables: Sequence[Sequence[int]]
    num_logits: int = 1

    def __post_init__(self) -> None:
        if len(self.token_ids) < 1:
            raise ValueError("token_ids must hold at least one token")
        if not isinstance(self.start_position, int) or self.start_position < 0:
            raise ValueError(f"start_position must be an int >= 0, got {self.start_position!r}")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(
                f"num_logits must be in [0, {len(self.token_ids)}], got {self.num_logits!r}"
            )


def _check_bucket(name: str, needed: int, bucket: int) -> None:
    if needed > bucket:
        raise ValueError(f"{name} bucket {bucket} is too small for {needed}")


def _slots(
    chunk: RequestChunk, req: int, group: int, page_size: int, max_pages: int, num_pages: int | None
) -> np.ndarray:  # [len(chunk.token_ids)]
    table = np.asarray(chunk.page_tables[group], dtype=np.int64)
    if len(table) > max_pages:
        raise ValueError(
            f"request {req} group {group} has {len(table)} pages, more than "
            f"max_pages_per_req={max_pages}"
        )
    if num_pages is not None and len(table) and (table.min() < 0 or table.max() >= num_pages):
        raise ValueError(f"request {req} group {group} page ids must lie in [0, {num_pages})")
    positions = chunk.start_position + np.arange(len(chunk.token_ids))
    logical = positions // page_size
    if logical[-1] >= len(table):
        raise ValueError(
            f"request {req} group {group} needs page {int(logical[-1])} for position "
            f"{int(positions[-1])} but its page table has {len(table)} entries"
        )
    pages = table[logical]
    if np.any(pages == NULL_PAGE):
        raise ValueError(
            f"request {req} group {group} would write into the null page {NULL_PAGE}"
        )
    return pages * page_size + positions % page_size


def build_forward_batch(
    chunks: Sequence[RequestChunk],
    *,
    page_size: int,
    num_groups: int,
    num_tokens_bucket: int,
    num_reqs_bucket: int,
    max_pages_per_req: int,
    num_logits_bucket: int | None = None,
    num_pages: int | None = None,
) -> ForwardBatch:
    """Pad the requests of one step into a ForwardBatch of numpy int32 arrays.

    num_logits_bucket defaults to num_reqs_bucket; num_pages, when given,
    bounds the page ids.
    """
    logits_bucket = num_reqs_bucket if num_logits_bucket is None else num_logits_bucket
    total = sum(len(c.token_ids) for c in chunks)
    _check_bucket("num_tokens", total, num_tokens_bucket)
    _check_bucket("num_reqs", len(chunks), num_reqs_bucket)
    _check_bucket("num_logits", sum(c.num_logits for c in chunks), logits_bucket)
    t, r = num_tokens_bucket, num_reqs_bucket
    ids, pos, req_of = (np.zeros(t, np.int32) for _ in range(3))
    slots = np.full((num_groups, t), NULL_PAGE * page_size, np.int32)
    tables = np.full((num_groups, r, max_pages_per_req), NULL_PAGE, np.int32)
    qsl = np.full(r + 1, total, np.int32)
    seq_lens = np.zeros(r, np.int32)
    logits: list[int] = []
    start = 0
    for req, chunk in enumerate(chunks):
        if len(chunk.page_tables) != num_groups:
            raise ValueError(
                f"request {req} has {len(chunk.page_tables)} page tables for {num_groups} groups"
            )
        n = len(chunk.token_ids)
        rows = slice(start, start + n)
        ids[rows] = chunk.token_ids
        pos[rows] = chunk.start_position + np.arange(n)
        req_of[rows] = req
        for g in range(num_groups):
            slots[g, rows] = _slots(chunk, req, g, page_size, max_pages_per_req, num_pages)
            tables[g, req, :len(chunk.page_tables[g])] = chunk.page_tables[g]
        qsl[req] = start
        seq_lens[req] = chunk.start_position + n
        logits.extend(range(start + n - chunk.num_logits, start + n))
        start += n
    logits_indices = np.zeros(logits_bucket, np.int32)
    logits_indices[:len(logits)] = logits
    return ForwardBatch(ids, pos, req_of, slots, tables, qsl, seq_lens, logits_indices)


def tiled_rows(num_tokens_bucket: int, num_reqs_bucket: int, tile: int) -> int:
    """Rows of the tiled layout: room for every request's rounding plus the padding."""
    padded = num_tokens_bucket + num_reqs_bucket * (tile - 1)
    return -(-padded // tile) * tile


def tile_layout(num_scheduled: np.ndarray, num_tokens_bucket: int, num_reqs_bucket: int,
                tile: int) -> tuple[np.ndarray, np.ndarray]:
    """(tile_rows [T_tiled], row_in_tiles [T]) regrouping each request's rows,
    which are consecutive in the flat layout, into whole tiles of its own.

    num_scheduled: [R] tokens per request, in flat-row order. A request's last
    tile is filled with copies of its last row; unused tiles repeat the last
    flat row.
    """
    size = tiled_rows(num_tokens_bucket, num_reqs_bucket, tile)
    n = num_scheduled.astype(np.int64)
    flat_start = np.cumsum(n) - n
    tiles_of = -(-n // tile)
    tiled_start = (np.cumsum(tiles_of) - tiles_of) * tile
    tile_rows = np.full(size, num_tokens_bucket - 1, np.int32)
    row_in_tiles = np.full(num_tokens_bucket, size - 1, np.int32)
    req = np.repeat(np.arange(len(n)), tiles_of * tile)
    offset = np.arange(len(req)) - np.repeat(tiled_start, tiles_of * tile)
    tile_rows[:len(req)] = flat_start[req] + np.minimum(offset, n[req] - 1)
    total = int(n.sum())
    flat_req = np.repeat(np.arange(len(n)), n)
    row_in_tiles[:total] = tiled_start[flat_req] + (np.arange(total) - flat_start[flat_req])
    return tile_rows, row_in_tiles
