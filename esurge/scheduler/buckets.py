"""Request-count buckets: the batch sizes the runner pads to."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["SeqBuckets"]


class SeqBuckets:
    """Maps a running-request count to the bucket the runner pads to.

    With explicit buckets the count may never exceed the largest one, so
    `max_running` caps admission. Without them the bucket is the smallest power
    of two >= the count, capped at max_num_seqs.
    """

    __slots__ = ("_table", "buckets", "max_running")

    def __init__(self, buckets: Sequence[int] | None, max_num_seqs: int) -> None:
        if buckets is not None:
            buckets = tuple(buckets)
            ok = (
                len(buckets) > 0
                and all(isinstance(b, int) and not isinstance(b, bool) for b in buckets)
                and all(1 <= b <= max_num_seqs for b in buckets)
                and all(a < b for a, b in itertools.pairwise(buckets))
            )
            if not ok:
                raise ValueError(
                    "max_num_seq_buckets must be a non-empty, strictly increasing sequence "
                    f"of ints in [1, max_num_seqs={max_num_seqs}], got {buckets!r}"
                )
        self.buckets: tuple[int, ...] | None = buckets
        self.max_running = buckets[-1] if buckets is not None else max_num_seqs
        # A lookup table: bucket selection runs every step.
        table = [0] * (self.max_running + 1)
        for count in range(self.max_running + 1):
            table[count] = self._select(max(count, 1), max_num_seqs)
        self._table = table

    def _select(self, count: int, max_num_seqs: int) -> int:
        if self.buckets is not None:
            return next(b for b in self.buckets if b >= count)
        return min(1 << (count - 1).bit_length(), max_num_seqs)

    def bucket_for(self, count: int) -> int:
        """The bucket for `count` requests (the smallest one for an empty step)."""
        if not 0 <= count <= self.max_running:
            raise ValueError(f"count must be in [0, {self.max_running}], got {count!r}")
        return self._table[count]
