"""Padding buckets for the (token count, request count) shape of a step."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["FINE_BUCKETS_FROM", "QUARTER_BUCKETS_FROM", "StepBuckets"]

# From this many tokens up, token buckets also step by 1.5x, and from
# QUARTER_BUCKETS_FROM by quarters (1.25x, 1.5x, 1.75x): a large step costs in
# proportion to its padded size (a 1031-token step in a 2048 bucket did twice
# the work, in a 1536 one half again), and the few extra programs compile at
# warm-up.
FINE_BUCKETS_FROM = 512
QUARTER_BUCKETS_FROM = 1024


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out: list[int] = []
    size = lo
    while size < hi:
        out.append(size)
        size *= 2
    out.append(hi)
    return out


def _token_ladder(lo: int, hi: int) -> list[int]:
    out: list[int] = []
    size = lo
    while size < hi:
        out.append(size)
        quarters = ((5, 6, 7) if size >= QUARTER_BUCKETS_FROM
                    else (6,) if size >= FINE_BUCKETS_FROM else ())
        out.extend(size * q // 4 for q in quarters if size * q // 4 < hi)
        size *= 2
    out.append(hi)
    return out


@dataclass(frozen=True, slots=True)
class StepBuckets:
    """Token buckets (powers of two up to the step budget, with 1.5x steps in
    between from FINE_BUCKETS_FROM and quarter steps from QUARTER_BUCKETS_FROM)
    and request buckets.

    Every step pads to the smallest token and request buckets that hold it, so
    the set of compiled shapes is fixed and known at warm-up.
    """

    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]

    @classmethod
    def create(cls, max_num_batched_tokens: int, max_num_seqs: int,
               seq_buckets: tuple[int, ...] | None = None, min_tokens: int = 16,
               min_requests: int = 4) -> StepBuckets:
        """Buckets for a step budget and request limit."""
        requests = list(seq_buckets) if seq_buckets else _powers_of_two(
            min(min_requests, max_num_seqs), max_num_seqs)
        if requests[-1] < max_num_seqs:
            requests.append(max_num_seqs)
        tokens = _token_ladder(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        return cls(tuple(tokens), tuple(requests))

    def tokens_for(self, num_tokens: int) -> int:
        """Smallest token bucket >= num_tokens."""
        return self._pick(self.token_buckets, num_tokens, "num_tokens")

    def requests_for(self, num_requests: int) -> int:
        """Smallest request bucket >= num_requests."""
        return self._pick(self.request_buckets, num_requests, "num_requests")

    @staticmethod
    def _pick(buckets: tuple[int, ...], n: int, what: str) -> int:
        i = bisect.bisect_left(buckets, n)
        if i == len(buckets):
            raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")
        return buckets[i]

    @property
    def request_floor(self) -> int:
        """The request dimension below which plain model steps do not go: the
        largest request bucket that fits in the smallest token bucket.

        The model's kernels skip padded requests and logits rows, so a smaller
        request bucket saves a model step nothing but costs one compiled model
        step per token bucket. The sampler keeps the step's own request
        bucket: the host builds its tensors for every row of it.
        """
        fitting = [r for r in self.request_buckets if r <= self.token_buckets[0]]
        return fitting[-1] if fitting else self.request_buckets[0]

    def model_requests(self, requests_bucket: int) -> int:
        """The request dimension of a plain model step in this request bucket."""
        return max(requests_bucket, self.request_floor)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (tokens, requests) bucket pair a step can land in.

        A step of R requests has at least R tokens, so request bucket r pairs
        with token bucket t when some R in (previous request bucket, r] fits in t.
        """
        previous = (0, *self.request_buckets[:-1])
        return [(t, r) for t in self.token_buckets
                for r, lower in zip(self.request_buckets, previous, strict=True) if lower < t]
