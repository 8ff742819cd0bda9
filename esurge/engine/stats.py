"""The engine's numbers, published by the loop thread once per loop turn.

Only the loop thread reads the scheduler, the cache and the runner; it
copies what other threads may want into one immutable `EngineStats` and
swaps it in with a single reference assignment, so a reader on any thread
(GetLoad, admission, metrics) gets a consistent view without a lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from esurge.scheduler.scheduler import Scheduler
from esurge.spec_decode.stats import SpecStatsSnapshot

__all__ = ["EngineStats", "StatsRecorder"]

_NO_SPEC = SpecStatsSnapshot(0, 0, 0)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One consistent reading of the engine (counters are totals since start)."""

    timestamp: float  # time.monotonic() when it was taken
    num_steps: int
    num_running: int
    num_waiting: int
    page_size: int
    num_pages: int  # the pool, the null page included
    num_usable_pages: int
    num_free_pages: int  # free now, evictable cached pages included
    num_cached_pages: int  # registered under a content hash, held or free
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    spec: SpecStatsSnapshot  # all zero without speculative decoding
    last_step_seconds: float
    total_step_seconds: float
    num_prompt_tokens: int  # of requests accepted
    num_generation_tokens: int  # delivered to callers

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens (0.0 before any lookup)."""
        queried = self.prefix_cache_queries
        return self.prefix_cache_hits / queried if queried else 0.0


class StatsRecorder:
    """Counts on the loop thread and builds each published EngineStats."""

    def __init__(self, scheduler: Scheduler,
                 spec_stats: Callable[[], SpecStatsSnapshot | None]) -> None:
        self._scheduler = scheduler
        self._spec_stats = spec_stats
        self.num_steps = 0
        self.last_step_seconds = 0.0
        self.total_step_seconds = 0.0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def step_done(self, seconds: float, num_generated: int) -> None:
        """Count one engine step."""
        self.num_steps += 1
        self.last_step_seconds = seconds
        self.total_step_seconds += seconds
        self.num_generation_tokens += num_generated

    def read(self) -> EngineStats:
        """The numbers now; call on the loop thread only."""
        scheduler = self._scheduler
        kv = scheduler.kv_cache_manager
        running, waiting = scheduler.get_request_counts()
        return EngineStats(
            timestamp=time.monotonic(), num_steps=self.num_steps, num_running=running,
            num_waiting=waiting, page_size=kv.page_size, num_pages=kv.num_usable_pages + 1,
            num_usable_pages=kv.num_usable_pages, num_free_pages=kv.num_free_pages,
            num_cached_pages=kv.pool.num_cached_pages(), kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions, spec=self._spec_stats() or _NO_SPEC,
            last_step_seconds=self.last_step_seconds,
            total_step_seconds=self.total_step_seconds,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens)
