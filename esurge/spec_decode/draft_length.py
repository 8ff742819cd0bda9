"""How many drafts a speculative step should carry: step costs against expected gain.

A speculative step of B requests with d drafts each runs the target over
B * (d + 1) rows, the head over the same rows, and d - 1 more single-row
passes of the head; it gains 1 + a1 + a1*a2 + ... + a1*...*ad tokens per
request, where aj is the chance that draft j is accepted once drafts
1..j-1 were. The costs are measured at warm-up per batch size and draft
count (`StepCosts`, the runner's calibration), because on a CPU they are
far from linear in rows: the matmul kernels run rows in tiles (6 or 8 rows
a pass over the weights), so a step of 5 rows can cost what 6 do, and each
pass over the weights costs about what a 1-row step does. The acceptance
is measured online (`Acceptance`). `DraftLength` picks the d with the best
tokens per second, and says what that rate is against a plain step's,
which the speculation policy uses where it has not measured.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from esurge.spec_decode.overheads import StepOverheads

__all__ = ["Acceptance", "CostCurve", "DraftLength", "StepCosts", "batch_trial_rate",
           "chain_rate", "head_acceptance_prior"]


@dataclass(frozen=True, slots=True)
class CostCurve:
    """Seconds by size (rows or requests), measured at some sizes: linear between
    two measured sizes, and beyond the largest along the last two's slope."""

    points: tuple[tuple[int, float], ...]  # (size, seconds), sizes ascending
    sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("points must hold at least one (size, seconds) pair")
        sizes = [s for s, _ in self.points]
        if sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"points must have distinct sizes >= 1 in ascending order, "
                             f"got sizes {sizes!r}")
        if any(t < 0 for _, t in self.points):
            raise ValueError(f"points must have seconds >= 0, got {self.points!r}")
        object.__setattr__(self, "sizes", tuple(sizes))  # read on every step

    def at(self, size: int) -> float:
        """Seconds at `size` (at the smallest measured size for anything below it)."""
        sizes = self.sizes
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] == size:
            return self.points[i][1]
        if i == 0 or len(sizes) == 1:
            return self.points[0][1]  # below the first, or the only one
        lo, hi = (i - 1, i) if i < len(sizes) else (len(sizes) - 2, len(sizes) - 1)
        (s0, t0), (s1, t1) = self.points[lo], self.points[hi]
        return max(0.0, t0 + (t1 - t0) * (size - s0) / (s1 - s0))


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Decode steps' seconds by batch size, measured at warm-up."""

    plain_curve: CostCurve
    speculative_curves: tuple[CostCurve, ...]  # [d - 1]: steps verifying d drafts

    def __post_init__(self) -> None:
        if not self.speculative_curves:
            raise ValueError("speculative_curves must hold one curve per draft count >= 1")

    @property
    def k(self) -> int:
        """The most drafts measured."""
        return len(self.speculative_curves)

    def plain(self, batch: int) -> float:
        """A plain decode step of `batch` requests."""
        return self.plain_curve.at(batch)

    def speculative(self, batch: int, drafts: int) -> float:
        """A decode step of `batch` requests verifying and proposing `drafts` each."""
        if not 1 <= drafts <= self.k:
            raise ValueError(f"drafts must be in 1..{self.k}, got {drafts!r}")
        return self.speculative_curves[drafts - 1].at(batch)


@dataclass(slots=True)
class Acceptance:
    """Per draft position j, the chance that draft j is accepted once drafts 1..j-1
    were: decayed counts, so the estimate follows the workload, shrunk by
    `prior_weight` pseudo-verifications towards the estimate of position j - 1
    (position 1: towards `prior`). A position not drafted yet is assumed to
    accept as the one before it does: with a fixed prior for it, a head whose
    first drafts were accepted more often than the prior said kept being given
    one draft (the SmolLM2 head stayed at 1.2 drafts a step at batch 1, where
    4 a step ran 17% faster than 1 on the same prompts), since the later
    positions, never drafted, could not show otherwise. A position not
    drafted for a while drifts back to its predecessor's estimate and gets
    tried again. The counts decay slowly (about 500 steps): acceptance is
    mostly a property of the request, and a memory of one or two requests
    (0.99 a step, before) cut the SmolLM2 head to 2.6 drafts a step after
    a hard prompt (batch 1, held-out chats: 0.96-1.28x of plain decoding in
    three runs, against 1.26-1.28x drafting 4 on every step; now 1.27x and
    1.30x at 3.8 drafts a step)."""

    k: int
    prior: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.998  # per recorded step
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k!r}")
        if not 0.0 <= self.prior <= 1.0 or self.prior_weight <= 0 or not 0 < self.decay <= 1:
            raise ValueError(f"prior must be in [0, 1], prior_weight > 0 and decay in (0, 1], "
                             f"got {self.prior!r}, {self.prior_weight!r}, {self.decay!r}")
        self.reached = [0.0] * self.k
        self.accepted = [0.0] * self.k

    def record(self, verified: list[tuple[int, int]]) -> None:
        """One step's verifications: (drafts verified, drafts accepted) per request."""
        self.reached = [r * self.decay for r in self.reached]
        self.accepted = [a * self.decay for a in self.accepted]
        for drafts, accepted in verified:
            # Draft j was tested when every draft before it was accepted.
            for j in range(min(drafts, accepted + 1, self.k)):
                self.reached[j] += 1.0
                if j < accepted:
                    self.accepted[j] += 1.0

    def fade(self, factor: float) -> None:
        """Decay the counts by `factor` without a verification (a step that drafted
        nothing, where only drafting could refresh the estimate)."""
        if not 0 < factor <= 1:
            raise ValueError(f"factor must be in (0, 1], got {factor!r}")
        self.reached = [r * factor for r in self.reached]
        self.accepted = [a * factor for a in self.accepted]

    def rates(self, drafts: int) -> list[float]:
        """The estimates for draft positions 1..drafts (0 <= drafts <= k)."""
        if not 0 <= drafts <= self.k:
            raise ValueError(f"drafts must be in 0..{self.k}, got {drafts!r}")
        estimates, before = [], self.prior
        for j in range(drafts):
            before = ((self.accepted[j] + before * self.prior_weight)
                      / (self.reached[j] + self.prior_weight))
            estimates.append(before)
        return estimates

    def rate(self, position: int) -> float:
        """The estimate for draft `position` (1-based, at most k)."""
        if not 1 <= position <= self.k:
            raise ValueError(f"position must be in 1..{self.k}, got {position!r}")
        return self.rates(position)[-1]

    def expected_tokens(self, drafts: int) -> float:
        """Tokens a request gains from a step verifying `drafts` drafts."""
        total, chain = 1.0, 1.0
        for rate in self.rates(drafts):
            chain *= rate
            total += chain
        return total


@dataclass(slots=True)
class DraftLength:
    """The draft count with the best expected token rate at a batch size.

    What real steps cost beyond their measured parts is learnt online from
    the steps' measured costs (`observe`, `StepOverheads`: by batch size, a
    speculative step's as an extra over a plain one's): on SmolLM2 at batch 1
    a plain step took 8.0 ms where warm-up measured 6.9, and without the
    difference every prediction favoured plain steps by some 15%."""

    costs: StepCosts
    acceptance: Acceptance
    overheads: StepOverheads = field(default_factory=StepOverheads)

    def overhead(self, batch: int) -> float:
        """What a speculative step of `batch` requests costs beyond its measured
        parts (seconds)."""
        return self.overheads.speculative(batch)

    def plain_overhead(self, batch: int) -> float:
        """What a plain step of `batch` requests costs beyond its measured part."""
        return self.overheads.plain(batch)

    @property
    def k(self) -> int:
        """The most drafts a step may carry."""
        return self.acceptance.k

    def rate(self, batch: int, drafts: int, requests: Sequence[Acceptance] | None = None,
             riders: int = 0) -> float:
        """Expected tokens per second of decode steps with `drafts` drafts (0: plain);
        with `requests`, the mean of these requests' own expected tokens (else
        the engine-wide acceptance's). `riders` of the batch take no drafts (a
        token a step each) but pay for the others' in every step."""
        if drafts == 0:
            return batch / max(self.costs.plain(batch) + self.plain_overhead(batch), 1e-9)
        seconds = self.costs.speculative(batch, drafts) + self.overhead(batch)
        tokens = (sum(a.expected_tokens(drafts) for a in requests) / len(requests) if requests
                  else self.acceptance.expected_tokens(drafts))
        return ((batch - riders) * tokens + riders) / max(seconds, 1e-9)

    def best(self, batch: int, requests: Sequence[Acceptance] | None = None,
             riders: int = 0) -> int:
        """The draft count in 1..k with the best expected rate (see `rate`)."""
        return max(range(1, self.k + 1),
                   key=lambda d: (self.rate(batch, d, requests, riders), -d))

    def predicted_gain(self, batch: int, requests: Sequence[Acceptance] | None = None) -> float:
        """The best speculative rate over the plain rate at this batch size (see `rate`)."""
        return self.rate(batch, self.best(batch, requests), requests) / self.rate(batch, 0)

    def slowest_gain(self, batch: int, requests: Sequence[Acceptance], riders: int = 0) -> float:
        """What a speculative step at the best draft count for the batch (`best`)
        gains its slowest request against a plain step (a rider: one token a step)."""
        drafts = self.best(batch, requests, riders)
        if riders or not requests:
            slowest = self.rate(batch, drafts, requests, riders=batch)  # a token each
        else:
            worst = min(requests, key=lambda a: a.expected_tokens(drafts))
            slowest = self.rate(batch, drafts, (worst,))
        return slowest / self.rate(batch, 0)

    def observe(self, batch: int, drafts: int, seconds: float) -> None:
        """A measured decode step with `drafts` drafts a request (0: plain): moves
        that mode's overhead towards what the parts do not explain."""
        if batch < 1 or drafts < 0 or seconds <= 0:
            return
        speculative = drafts > 0
        cost = self.costs.speculative(batch, drafts) if speculative else self.costs.plain(batch)
        self.overheads.observe(batch, speculative, max(seconds - cost, 0.0))


def chain_rate(mean_length: float, k: int) -> float:
    """The per-position acceptance a with 1 + a + ... + a**k == mean_length (a
    head's measured mean acceptance length at k drafts), clipped to [0, 1]."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < mean_length:
            lo = mid
        else:
            hi = mid
    return lo


def batch_trial_rate(trial_rate: float, prior: float, batch: int) -> float:
    """The per-position acceptance a trial of `batch` requests bets on.

    `trial_rate` is an optimistic quantile of one request's acceptance (how
    often a head's drafts are accepted is mostly a property of the request);
    `prior` the head's measured mean. A batch's step gains by its requests'
    mean acceptance, whose spread about the head's mean shrinks as
    1/sqrt(batch), so the same quantile of it lies that much closer to the
    mean: a batch of 4 SmolLM2 chats betting on 0.8 took trial steps that
    lost (0.78-0.95x of plain decoding in some pairs); all 4 being that easy
    is far less likely than one being so."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch!r}")
    optimistic = max(trial_rate, prior)
    return prior + (optimistic - prior) / math.sqrt(batch)


def head_acceptance_prior(head_dir: Path, k: int, default: float = 0.6) -> float:
    """The per-position acceptance to assume before measuring any: from the mean
    acceptance length the head's trainer recorded (training_info.json, "eval"),
    else `default`."""
    try:
        info = json.loads((head_dir / "training_info.json").read_text())
        evaluation = info["eval"]
        return chain_rate(float(evaluation["mean_acceptance_length"]), int(evaluation["k"]))
    except (OSError, ValueError, KeyError, TypeError):
        return default
