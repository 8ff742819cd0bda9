"""The page pool's event log: evictions and clears are recorded once enabled."""

from __future__ import annotations

from esurge.core.kv_events import PagesCleared, PagesRemoved
from esurge.core.page_hash import hash_page
from esurge.core.page_pool import PagePool


def test_evictions_and_clears_are_logged_only_when_enabled() -> None:
    pool = PagePool(4)
    first, second = pool.take(2, 0)
    h1, h2 = hash_page(None, [1, 2]), hash_page(None, [3, 4])
    assert pool.cache_page(0, h1, first) and pool.cache_page(0, h2, second)
    pool.release([first, second])
    pool.take(3, 0)  # the free queue reaches both cached pages: both are evicted
    assert pool.events.drain() == []  # nobody asked: nothing kept
    pool = PagePool(4)
    pool.events.enabled = True
    first, second = pool.take(2, 0)
    pool.cache_page(0, h1, first)
    pool.cache_page(0, h2, second)
    pool.release([second, first])
    pool.take(3, 0)
    assert pool.events.drain() == [PagesRemoved(0, (h2, h1))]  # one event, in eviction order
    pool.release([1, 2, 3])  # the three usable pages, all held now
    assert pool.reset_cache()
    assert pool.events.drain() == [PagesCleared()]
