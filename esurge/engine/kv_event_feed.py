"""The prefix cache's events, numbered and kept for readers on other threads.

The engine loop drains the cache's event log after every step into numbered
batches (one per step that changed the cache); readers (a gRPC stream per
subscribed gateway) take the batches after the last number they saw. The
feed keeps the most recent batches only: a reader that falls further behind
starts over from a clear. Recording starts with the first subscriber, and
the first batch then begins with a clear, so a reader's index starts empty.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from esurge.core.kv_events import KVEvent, KVEventLog, PagesCleared

__all__ = ["KVEventBatch", "KVEventFeed"]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One step's cache events."""

    sequence: int  # from 1, consecutive
    timestamp: float  # time.time()
    events: tuple[KVEvent, ...]


class KVEventFeed:
    """Numbered batches of cache events; publish on the loop thread, read anywhere."""

    def __init__(self, max_batches: int = 4096) -> None:
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)
        self._lock = threading.Lock()
        self._wanted = False
        self._starting = False  # the next batch opens with a clear
        self._sequence = 0

    def subscribe(self) -> None:
        """Start recording (the loop turns the cache's log on at its next step)."""
        self._wanted = True

    @property
    def last_sequence(self) -> int:
        """The number of the newest batch (0 before any)."""
        return self._sequence

    def prepare(self, log: KVEventLog) -> None:
        """Before a step (loop thread): start recording once someone subscribed."""
        if self._wanted and not log.enabled:
            log.enabled = True
            self._starting = True

    def publish(self, log: KVEventLog) -> None:
        """After a step (loop thread): move the log's events into a new batch."""
        if not log.enabled:
            return
        events: list[KVEvent] = [PagesCleared()] if self._starting else []
        self._starting = False
        events.extend(log.drain())
        if not events:
            return
        with self._lock:
            self._sequence += 1
            self._batches.append(KVEventBatch(self._sequence, time.time(), tuple(events)))

    def after(self, sequence: int) -> list[KVEventBatch]:
        """Batches numbered above `sequence`, oldest first (all kept ones if it is gone)."""
        with self._lock:
            return [b for b in self._batches if b.sequence > sequence]
