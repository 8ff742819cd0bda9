"""Engine-wide speculative decoding counters.

One "verification" is one request in one step that had drafts to verify. Its
acceptance length is the number of tokens it emitted in that step (accepted
drafts plus the target's own token), so mean_acceptance_length is the
average number of tokens a request gains per target forward while drafting
(1.0 would mean no draft was ever accepted).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["SpecDecodeStats", "SpecStatsSnapshot"]


@dataclass(frozen=True, slots=True)
class SpecStatsSnapshot:
    """A consistent copy of the counters (safe to hand to another thread)."""

    num_verifications: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification (0.0 before any)."""
        if not self.num_verifications:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verifications


class SpecDecodeStats:
    """Counters the runner updates each step and any thread may read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._verifications = 0
        self._drafted = 0
        self._accepted = 0
        # The engine loop reads the counters every step, mostly unchanged: the
        # last snapshot (immutable) is handed out again until a count moves.
        self._snapshot: SpecStatsSnapshot | None = None

    def record(self, num_verifications: int, num_drafted: int, num_accepted: int) -> None:
        """Add one step's totals."""
        if min(num_verifications, num_drafted, num_accepted) < 0 or num_accepted > num_drafted:
            raise ValueError(f"bad step totals: verifications={num_verifications}, "
                             f"drafted={num_drafted}, accepted={num_accepted}")
        with self._lock:
            self._verifications += num_verifications
            self._drafted += num_drafted
            self._accepted += num_accepted
            self._snapshot = None

    def snapshot(self) -> SpecStatsSnapshot:
        """The counters now."""
        with self._lock:
            if self._snapshot is None:
                self._snapshot = SpecStatsSnapshot(self._verifications, self._drafted,
                                                   self._accepted)
            return self._snapshot

    def reset(self) -> None:
        """Zero the counters (e.g. between benchmark phases)."""
        with self._lock:
            self._verifications = self._drafted = self._accepted = 0
            self._snapshot = None
