"""Page arithmetic: how many pages a request holds at most, when a windowed
group can give its next page back, and how a memory budget becomes a pool size."""

from __future__ import annotations

from collections.abc import Sequence

from esurge.core.kv_cache_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
)

__all__ = ["computed_reaching", "peak_pages", "stable_page_count"]

# Significant bits kept when a memory budget sets the pool size.
_POOL_SIZE_BITS = 5


def stable_page_count(pages: int) -> int:
    """`pages` rounded down to 5 significant bits (less than 1/16 lost).

    The pool size is part of every compiled program's shape. Sized from free
    memory, it would differ by a few pages from one start to the next and
    miss the persistent compile cache every time; rounded, small changes in
    free memory give the same pool and the same programs.
    """
    if pages < 1:
        raise ValueError(f"pages must be >= 1, got {pages!r}")
    step = 1 << max(pages.bit_length() - _POOL_SIZE_BITS, 0)
    return pages - pages % step


def _reach(spec: AttentionSpec) -> int | None:
    """Positions a query reads, itself included (None: the whole sequence)."""
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return spec.attention_chunk_size
    return None


def peak_pages(specs: Sequence[AttentionSpec], num_tokens: int,
               max_tokens_per_step: int | None = None) -> int:
    """Most pages, over all groups, a request of num_tokens tokens holds at once.

    A windowed group holds its reach plus one step's tokens; None for
    max_tokens_per_step means the whole request in one step.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens!r}")
    step = num_tokens if max_tokens_per_step is None else max_tokens_per_step
    if step < 1 and num_tokens > 0:
        raise ValueError(f"max_tokens_per_step must be >= 1, got {max_tokens_per_step!r}")
    total = 0
    for spec in specs:
        whole = -(-num_tokens // spec.page_size)
        reach = _reach(spec)
        if reach is None:
            total += whole
        else:
            # A step's tokens plus the reach - 1 positions before its first one,
            # spread over at most one page more than they fill.
            total += min(whole, -(-(reach + step - 2) // spec.page_size) + 1)
    return total


def computed_reaching(spec: AttentionSpec, token: int) -> int:
    """Least num_computed whose first_needed_token is >= token (token >= 1)."""
    if isinstance(spec, SlidingWindowSpec):
        return token + spec.sliding_window - 1
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk = spec.attention_chunk_size
        return -(-token // chunk) * chunk
    raise ValueError(f"{type(spec).__name__} reads the whole sequence: it never gives pages back")
