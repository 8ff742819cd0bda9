"""Finding the longest cached prefix that every cache group can serve.

A prefix of L whole pages is usable only if each group can provide what the
next query (at position L * page_size) reads: a full-attention group needs all
L pages cached, a windowed group only the pages covering
[first_needed_token(L * page_size), L * page_size); its earlier entries become
the null page.
"""

from __future__ import annotations

from esurge.core.kv_cache_spec import AttentionSpec
from esurge.core.page_hash import PageHash
from esurge.core.page_pool import NULL_PAGE, PagePool

__all__ = ["hit_pages", "longest_hit"]


def longest_hit(pool: PagePool, specs: tuple[AttentionSpec, ...],
                windowed: tuple[int, ...], hashes: list[PageHash], limit: int) -> int:
    """Longest prefix (in pages, <= limit) all groups agree on.

    Each group's rule maps a bound to its longest valid prefix under it, and a
    prefix valid for a full group stays valid when shortened, so lowering the
    bound until the windowed groups stop moving it gives the longest common one.
    """
    num = limit
    for g in range(len(specs)):
        if g in windowed:
            continue
        index = pool.cached_pages(g)
        hit = 0
        while hit < num and hashes[hit] in index:
            hit += 1
        num = hit
    while num > 0 and windowed:
        before = num
        for g in windowed:
            num = _window_hit(pool, specs[g], g, hashes, num)
        if num == before:
            break
    return num


def _window_hit(pool: PagePool, spec: AttentionSpec, group: int,
                hashes: list[PageHash], limit: int) -> int:
    index = pool.cached_pages(group)
    page_size = spec.page_size
    num = limit
    while num > 0:
        start = spec.first_needed_token(num * page_size) // page_size
        miss = num - 1
        while miss >= start and hashes[miss] in index:
            miss -= 1
        if miss < start:
            return num
        # Every shorter prefix above `miss` needs page `miss` too: its reach starts no later.
        num = miss
    return 0


def hit_pages(pool: PagePool, specs: tuple[AttentionSpec, ...], hashes: list[PageHash],
              num_hit: int) -> tuple[tuple[int, ...], ...]:
    """Positional page entries per group for a prefix of num_hit cached pages."""
    pages: list[tuple[int, ...]] = []
    for g, spec in enumerate(specs):
        index = pool.cached_pages(g)
        start = spec.first_needed_token(num_hit * spec.page_size) // spec.page_size
        pages.append((NULL_PAGE,) * start + tuple(index[h] for h in hashes[start:num_hit]))
    return tuple(pages)
