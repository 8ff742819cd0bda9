"""Which requests keep drafting: each one's own acceptance against the step costs.

How often a head's drafts are accepted is mostly a property of the request
(SmolLM2's head on held-out chats: 1.5 to 4.2 tokens a verification), so a
verdict for a whole batch size either keeps drafting for requests it does
not pay for or stops it for those it does. The gate follows each drafting
request's own acceptance per draft position (`Acceptance`, shrunk towards
the engine-wide estimate) and, once it has seen `min_verifications` of the
request's verifications, stops its drafts when no draft count's expected
tokens per second at the step's batch size (the warm-up step costs plus the
overhead measured since, `DraftLength`) reaches `margin` times a plain
step's. Before that, from `early_verifications` on, it stops a request that
would lose even if its first drafts were accepted as often as the upper end
of what its verifications allow (`confidence` standard deviations above the
mean of a Beta posterior whose prior is the engine-wide estimate): where
recent requests drafted badly (random-token prompts) a request that fails
its first two or three verifications stops there instead of after eight,
while where they drafted well (chats) it takes five or six straight
failures. A stopped request decodes plainly to its end (its own drafts
lose; unlike a request whose batch stopped drafting, it never computes the
tokens its head missed again). A stopped request would still ride in
its batch's speculative steps, waiting for the others' drafts, and a batch
drains at the pace of its slowest request: the policy weighs the batch by
that one (`mix_gain`, `SpeculationPolicy.mix_pays`), from every request's
first verification on.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from esurge.spec_decode.draft_length import Acceptance, DraftLength

__all__ = ["RequestGate"]


@dataclass(slots=True)
class RequestGate:
    """Per-request acceptance, and whether drafting still pays for a request."""

    min_verifications: int = 8
    # Below break-even: a stop is for good (the head's cache misses a plain
    # step's tokens) while drafting on can still stop later, and a request's
    # acceptance moves over its answer. SmolLM2 at batch 1, held-out chats:
    # one accepted 5 of its first 39 drafts, was stopped at a predicted 0.98x
    # with a margin of 1.0 and decoded at 182 tok/s, where drafting on every
    # step reached 285; with 0.9 it drafted on and ran at 268. Seven chats one
    # after another took 2.91 / 3.09 / 3.25 s against 3.13 / 3.24 / 3.29 in
    # three alternating runs (drafting on every step: 2.89).
    margin: float = 0.9
    prior_weight: float = 4.0
    # SmolLM2 bf16 at batch 1 on random-token prompts: eight or nine trial
    # verifications, each about 12 ms against 7 for a plain step and gaining
    # 1.05 tokens, cost a 128-token request 4-5% (0.95x of plain decoding).
    early_verifications: int = 2
    confidence: float = 1.645  # one-sided 95% under a normal approximation
    # Each drafting request's acceptance; with no decay, position 1's count is
    # its verifications so far.
    _seen: dict[str, Acceptance] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.min_verifications < 1:
            raise ValueError(f"min_verifications must be >= 1, got {self.min_verifications!r}")
        if self.margin <= 0 or self.prior_weight <= 0:
            raise ValueError(f"margin and prior_weight must be > 0, got {self.margin!r}, "
                             f"{self.prior_weight!r}")
        if self.early_verifications < 1:
            raise ValueError(f"early_verifications must be >= 1, got "
                             f"{self.early_verifications!r}")
        if not math.isfinite(self.confidence) or self.confidence < 0:
            raise ValueError(f"confidence must be finite and >= 0, got {self.confidence!r}")

    def record(self, req_id: str, drafts: int, accepted: int, lengths: DraftLength) -> None:
        """One verification of `drafts` drafts of which the first `accepted` matched."""
        own = self._seen.get(req_id)
        if own is None:
            # The engine-wide estimate for the first position, when the request
            # starts: the request's own verifications then move it.
            own = self._seen[req_id] = Acceptance(lengths.k, prior=lengths.acceptance.rate(1),
                                                  prior_weight=self.prior_weight, decay=1.0)
        own.record([(drafts, accepted)])

    def acceptance_of(self, req_id: str) -> Acceptance | None:
        """The request's own acceptance, None before its first verification."""
        return self._seen.get(req_id)

    def pays(self, req_id: str, batch: int, lengths: DraftLength) -> bool:
        """False once the request's own acceptance says its drafts lose at this batch size."""
        own = self._seen.get(req_id)
        if own is None:
            return True
        seen = own.reached[0]
        if seen >= self.min_verifications:
            return lengths.predicted_gain(batch, (own,)) >= self.margin
        if seen >= self.early_verifications:
            return lengths.predicted_gain(batch, (self.optimistic(own),)) >= self.margin
        return True

    def optimistic(self, own: Acceptance) -> Acceptance:
        """The request's acceptance with its first position's estimate at the
        upper end of what its verifications allow: the mean of the Beta
        posterior (prior: the estimate it started from, weighing prior_weight
        verifications) plus `confidence` standard deviations. The later
        positions, shrunk towards it, rise with it."""
        a = own.accepted[0] + own.prior * own.prior_weight
        b = own.reached[0] - own.accepted[0] + (1.0 - own.prior) * own.prior_weight
        n = a + b
        upper = min(1.0, a / n + self.confidence * math.sqrt(a * b / (n * n * (n + 1.0))))
        raised = upper * (own.reached[0] + own.prior_weight) - own.prior * own.prior_weight
        bound = Acceptance(own.k, own.prior, own.prior_weight, own.decay)
        bound.reached = list(own.reached)
        bound.accepted = [max(raised, own.accepted[0]), *own.accepted[1:]]
        return bound

    def mix_gain(self, req_ids: Sequence[str], drafting: Collection[str],
                 lengths: DraftLength, trial: Acceptance) -> float:
        """The predicted gain of a speculative step of these requests for its
        slowest one (DraftLength.slowest_gain): each of the `drafting` ones at
        its own acceptance from its first verification on (shrunk towards the
        engine-wide estimate), at `trial` (the policy's trial acceptance)
        before it; the others take no drafts (riders, one token a step)."""
        own = [self._seen.get(req_id) or trial for req_id in req_ids if req_id in drafting]
        return lengths.slowest_gain(len(req_ids), own, riders=len(req_ids) - len(own))

    def release(self, req_ids: Iterable[str]) -> None:
        """Forget requests that left the batch."""
        for req_id in req_ids:
            self._seen.pop(req_id, None)
