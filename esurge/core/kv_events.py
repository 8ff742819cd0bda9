"""Events of the prefix cache: pages stored under a content hash, and evicted.

Gateways that route by cache contents (smg's cache-aware policy) keep an
index of each worker's cached pages from these, instead of guessing from what
they routed. A stored event carries the page's hash, its parent's and its
token ids; a removed event the hashes that left the index; a cleared event
says the whole cache was forgotten. Recording is off until a consumer turns
it on, and the log is bounded: a consumer that stops draining loses the
oldest events (it resyncs from a clear).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from esurge.core.page_hash import PageHash

__all__ = ["KVEvent", "KVEventLog", "PagesCleared", "PagesRemoved", "PagesStored"]


@dataclass(frozen=True, slots=True)
class PagesStored:
    """Full pages registered under their hashes, in chain order."""

    group: int
    parent: PageHash | None  # the hash of the page before the first one, if any
    hashes: tuple[PageHash, ...]
    token_ids: tuple[tuple[int, ...], ...]  # one tuple of page_size ids per page
    page_size: int
    cache_salt: str | None = None  # the request's salt, which the hashes include


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """Pages whose hashes left the index (evicted for reuse)."""

    group: int
    hashes: tuple[PageHash, ...]


@dataclass(frozen=True, slots=True)
class PagesCleared:
    """Every hash was forgotten."""


KVEvent = PagesStored | PagesRemoved | PagesCleared


class KVEventLog:
    """A bounded log the cache writes to and one consumer drains (same thread)."""

    def __init__(self, max_events: int = 100_000) -> None:
        self.enabled = False
        self._events: deque[KVEvent] = deque(maxlen=max_events)

    def stored(self, group: int, parent: PageHash | None, hashes: Sequence[PageHash],
               token_ids: Sequence[int], page_size: int, cache_salt: str | None = None) -> None:
        """Record consecutive pages stored; token_ids holds all of their ids."""
        if not self.enabled or not hashes:
            return
        pages = tuple(tuple(token_ids[i * page_size:(i + 1) * page_size])
                      for i in range(len(hashes)))
        self._events.append(PagesStored(group, parent, tuple(hashes), pages, page_size,
                                        cache_salt))

    def removed(self, group: int, page_hash: PageHash) -> None:
        """Record one page evicted (merged into the previous removal of the group)."""
        if not self.enabled:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, PagesRemoved) and last.group == group:
            self._events[-1] = PagesRemoved(group, (*last.hashes, page_hash))
        else:
            self._events.append(PagesRemoved(group, (page_hash,)))

    def cleared(self) -> None:
        """Record that every hash was forgotten."""
        if self.enabled:
            self._events.append(PagesCleared())

    def drain(self) -> list[KVEvent]:
        """The events since the last drain, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events
