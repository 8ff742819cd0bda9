"""What requests that have not drafted yet bet on when they try drafting.

Before a request has drafted, nothing of its own says how often its drafts
will be accepted. The policy lets it try where a request accepting a
generous rate would gain by the policy's margin (`SpeculationPolicy.
trial_rate`, an optimistic quantile of one request's acceptance). A batch
gains by its requests' mean acceptance, whose spread shrinks as
1/sqrt(batch) about its centre (`batch_trial_rate`), so larger batches bet
closer to the centre.

The centre is how the last requests' trials went on this server, not the
rate the head's trainer recorded: the two part where the traffic differs
from the head's training text. On random-token prompts (their first
drafts accepted ~0.1 a position against SmolLM2's recorded 0.575) a batch
of 4 kept betting on 0.69, its predicted gain sat at the policy's margin
(1.10-1.33 against 1.2, moving with the measured step overheads), and
batches that tried paid the head's pass over their prompts and a few
losing steps (`bench/spec_decode.py --prompts random`: 0.87-1.00x of plain
decoding at batch 4 across runs). Each request counts alike: its first
`verifications` verifications only. The engine-wide estimate the draft
counts follow is no centre for a trial: requests whose drafts pay verify
many times more often than those the gate stops after two or three, so
after six easy chats it read 0.78 and a batch of 4 predicted 1.36x, past
the margin, where the recorded rate predicted 1.12x (the same run's
costs); these trials read 0.52-0.65 after chats. A request alone bets as far
above the centre as `trial_rate` lies above the recorded rate (requests
spread about their mean, and the spread is kept): where no trial's drafts
were accepted, a lone request stops trying too, sparing its prompt's pass
through the head and the two or three verifications before the gate's
early verdict (random-token prompts at batch 1, 24 sets paired against
plain decoding: 0.976x per set, 15 verifications, against 0.955x and 72
betting on `trial_rate` alone; chats, where every request tries either
way: 1.118x against 1.123x per set).

Requests that do not try record nothing, so an estimate that only trials
refresh could stay low for good once it fell (a server at batch 4 or more
whose easy traffic came back would never draft again): the counts fade over
plain decode steps too (`idle`), slowly enough that a stream of hard
requests alone keeps the estimate low.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from esurge.spec_decode.draft_length import (
    Acceptance,
    DraftLength,
    batch_trial_rate,
    chain_rate,
)

__all__ = ["TrialBets"]

# The resolution of the centre: bets are rebuilt only when it moves by this
# much (each is a chain-rate bisection and an Acceptance; asked several times a step).
_STEP = 0.01


@dataclass(slots=True)
class TrialBets:
    """The predicted gain of a trial by batch size (`gain`), betting on how the
    first verifications of recent requests went (see the module docstring)."""

    lengths: DraftLength
    trial_rate: float
    prior: float  # the head's recorded per-position acceptance: the centre at first
    verifications: int = 2  # of each request (the gate's early verdict comes after 2)
    decay: float = 0.98  # per recorded verification: about the last 25 requests
    idle_decay: float = 0.9995  # per plain decode step: about 2,000 steps
    trials: Acceptance = field(init=False)
    _centres: dict[int, float] = field(default_factory=dict, repr=False)
    _bets: dict[tuple[int, int], Acceptance] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("trial_rate", "prior"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.verifications < 1:
            raise ValueError(f"verifications must be >= 1, got {self.verifications!r}")
        if not 0 < self.idle_decay <= 1:
            raise ValueError(f"idle_decay must be in (0, 1], got {self.idle_decay!r}")
        self.trials = Acceptance(self.lengths.k, prior=self.prior, decay=self.decay)

    def record(self, verification: int, drafts: int, accepted: int) -> None:
        """A request's `verification`-th verification (1-based): `drafts` drafts of
        which the first `accepted` matched; only its first `verifications` count."""
        if 1 <= verification <= self.verifications:
            self.trials.record([(drafts, accepted)])

    def idle(self) -> None:
        """A plain decode step: what the trials said fades by `idle_decay`."""
        self.trials.fade(self.idle_decay)

    def centre(self) -> float:
        """The per-position acceptance of recent trials (a chain rate: the one rate
        giving the same expected tokens at k drafts), to `_STEP`."""
        k = self.trials.k
        mean = round(self.trials.expected_tokens(k) / _STEP)
        rate = self._centres.get(mean)
        if rate is None:
            rate = self._centres[mean] = chain_rate(mean * _STEP, k)
        return rate

    def bet(self, batch: int) -> Acceptance:
        """The acceptance a trial of `batch` requests bets on (every position alike):
        as far above the centre as `trial_rate` lies above the recorded rate, less
        by 1/sqrt(batch)."""
        centre = self.centre()
        key = (batch, round(centre / _STEP))
        bet = self._bets.get(key)
        if bet is None:
            optimistic = min(1.0, centre + max(self.trial_rate - self.prior, 0.0))
            rate = batch_trial_rate(optimistic, centre, batch)
            bet = self._bets[key] = Acceptance(self.lengths.k, prior=rate)
        return bet

    def gain(self, batch: int) -> float:
        """The speculative rate over the plain one a trial of `batch` requests expects."""
        return self.lengths.predicted_gain(batch, (self.bet(batch),))
