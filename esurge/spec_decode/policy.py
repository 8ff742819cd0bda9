"""When speculation pays: the choice between a speculative step and a plain one.

Speculation costs more per step (the target verifies k + 1 rows per request,
the head drafts k tokens) and gains the accepted drafts. Alone on a CPU a
decode step is bound by streaming the weights, so verifying 5 rows costs about
what 1 does and speculation wins; with many requests the step is bound by
arithmetic, the extra rows cost their full price and speculation loses. Where
the line falls depends on the model, the machine and how often drafts are
accepted, so it is measured, not assumed: the runner reports every decode
step (its mode, how many requests it ran, the tokens they gained and its
wall time), and the policy keeps the token rate of each mode per batch size.

A plain step leaves the head's cache without the step's tokens, so a
request that took one drafts again only after computing those tokens again
where speculation pays at its batch size (HeadSync,
esurge/runner/steps/speculative/head_sync.py); new requests start drafting
where speculation pays at their batch size. Trying plain decoding at a batch
size is therefore paid by the requests of that step, and only after
speculation has been measured there.

How many drafts a speculative step carries (1 to k) is the runner's choice
from step costs measured at warm-up (esurge.spec_decode.draft_length); the
same costs tell this policy where speculation is not worth a trial.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["AdaptiveSpeculation", "SpeculationPolicy", "StepRate", "make_policy", "step_cost"]

MAX_HOST_GAP = 0.05  # seconds between two steps that still count as host work


def step_cost(started: float, collected: float, last_collected: float | None) -> float:
    """A decode step's cost in seconds, from when it began dispatching, when it was
    collected and when the step before it was.

    Decode steps follow each other at once, so the time since the previous
    collect is the step's whole cost, host work included. A step dispatched
    before that collect (async scheduling) ran behind the previous step and
    costs the same span, not the longer one since its own dispatch. A gap
    over MAX_HOST_GAP is a pause of the loop: the step's own time is taken.
    """
    if last_collected is not None and started - last_collected < MAX_HOST_GAP:
        return collected - last_collected
    return collected - started


@dataclass(slots=True)
class StepRate:
    """The recent steps of one mode at one batch size: (tokens, seconds) each.

    The first `settle` steps are not kept: a fresh process's first few dozen
    steps run up to a third slower (measured on the 4M test model), and would
    stand for the mode's rate.
    """

    settle: int = 16
    window: int = 512  # AdaptiveSpeculation.window
    recent: deque[tuple[int, float]] = field(init=False, repr=False)
    seen: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window!r}")
        self.recent = deque(maxlen=self.window)

    @property
    def samples(self) -> int:
        """Steps kept so far (after the settling ones)."""
        return max(0, self.seen - self.settle)

    @property
    def tokens_per_s(self) -> float:
        """Tokens over seconds of the recent steps (not a mean of per-step rates: a
        speculative step gains anything from 1 to k + 1 tokens); 0.0 before any is kept."""
        seconds = sum(s for _, s in self.recent)
        return sum(t for t, _ in self.recent) / seconds if seconds else 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One more step."""
        self.seen += 1
        if self.seen > self.settle:
            self.recent.append((tokens, seconds))


class SpeculationPolicy:
    """Speculate on every step ("always"); the base of the adaptive policy.

    drafts_seeded_samples: whether a sampled request with a seed may take
    drafts. A request without drafts samples exactly as plain decoding does,
    while one that takes drafts draws through rejection sampling (the same
    distribution, other tokens); where the steps' mode depends on measured
    timings, a seeded request therefore takes none, so its tokens depend on
    its seed alone.
    """

    drafts_seeded_samples = True
    # Whether each speculative step's draft count follows measured step costs
    # (SpecDecoder.calibrate); otherwise every step proposes k drafts.
    adapts_drafts = False
    # Whether a request stops drafting once its own acceptance says its drafts
    # lose (esurge.spec_decode.request_gate); "always" drafts for every request.
    gates_requests = False
    # Predicted speculative / plain token rate by batch size for a request
    # whose drafts are accepted at `trial_rate` per position, from the step
    # costs measured at warm-up (SpecDecoder.calibrate, DraftLength.predicted_gain);
    # None before them.
    predict_trial: Callable[[int], float] | None = None
    trial_rate = 0.8

    def speculate(self, batch: int, measurable: bool = True) -> bool:
        """True when a step of `batch` requests should draft (and verify).

        measurable: every request of the step decodes, so its rate can be
        measured (a step that carries prompt chunks cannot)."""
        return batch > 0

    def mix_pays(self, batch: int, gain: float) -> bool:
        """Whether a speculative batch keeps drafting: a step is predicted to gain
        its slowest request `gain` (RequestGate.mix_gain)."""
        return True

    def observe(self, speculative: bool, batch: int, tokens: int, seconds: float) -> None:
        """One decode step's outcome (ignored here)."""


class AdaptiveSpeculation(SpeculationPolicy):
    """Speculate at a batch size while its measured token rate beats plain decoding's.

    Seeded sampled requests take no drafts here (see SpeculationPolicy).

    Speculation must beat plain decoding's decode-step rate by `margin_at(batch)`
    (`margin`, plus `margin_per_doubling` for each doubling of the batch): its
    costs outside decode steps (the head's pass over every prompt, requests
    that finish on different steps) are not in that rate and grow with the
    batch (measured on the 4M test model at batch 4: a decode rate 7% above
    plain decoding's still lost 6% end to end), while alone a request gains
    1.2-1.7x from its head depending on the prompt.
    Unmeasured, speculation is tried first; once it has `min_samples` steps
    at a batch size and plain decoding none, plain decoding is tried there.
    A batch size measured in neither mode follows its neighbours where they
    decide it: speculation loses from a batch where it lost upward, and wins
    below a batch where it won. A step that cannot be measured (it carries
    prompt chunks: while a batch fills up, every step does) never explores:
    it takes the verdict of the nearest batch size measured in both modes.
    That is the policy without measured step costs; with them (`predict_trial`,
    once warm-up has run) it decides as `_by_costs` says.
    The first `settle` steps of each mode and batch size are not counted
    (StepRate). Rates are over the last `window` steps of each mode, which
    span many requests: how often a head's drafts are accepted is mostly a
    property of the request (SmolLM2's head on held-out chats: 1.5 to 4.2
    tokens a verification), so a window of one request's steps (32, before)
    turned speculation off after one unlucky request and kept it off for the
    next ones (batch 1: 0.96-1.02x of plain decoding, where speculating on
    every step gave 1.28x; with 512 steps, 0.96-1.28x, and 1.27-1.30x once
    the draft counts' acceptance estimates span requests too); where plain
    decoding won, speculation is measured again (`remeasure` steps in a row,
    joining the window) after every `refresh` plain steps.
    """

    drafts_seeded_samples = False
    adapts_drafts = True
    gates_requests = True

    def __init__(self, min_samples: int = 12, refresh: int = 256, remeasure: int = 8,
                 margin: float = 1.05, margin_per_doubling: float = 0.075,
                 settle: int = 16, window: int = 512) -> None:
        if min(min_samples, refresh, remeasure) < 1 or settle < 0:
            raise ValueError(f"min_samples, refresh and remeasure must be >= 1 and settle "
                             f">= 0, got {min_samples!r}, {refresh!r}, {remeasure!r}, "
                             f"{settle!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if margin < 1.0 or margin_per_doubling < 0:
            raise ValueError(f"margin must be >= 1 and margin_per_doubling >= 0, got "
                             f"{margin!r}, {margin_per_doubling!r}")
        self.margin = margin
        self.margin_per_doubling = margin_per_doubling
        self.settle = settle
        self.window = window
        self.min_samples = min_samples
        self.refresh = refresh
        self.remeasure = remeasure
        self.rates: dict[tuple[bool, int], StepRate] = {}
        # Plain steps per batch size since speculation was last measured there,
        # and speculative steps still owed to a re-measurement.
        self._plain_since: dict[int, int] = {}
        self._owed: dict[int, int] = {}

    def speculate(self, batch: int, measurable: bool = True) -> bool:
        if batch <= 0:
            return False
        if self.predict_trial is not None:
            return self._by_costs(batch, self.predict_trial)
        verdict = self._measured(batch)
        if verdict is False and self._remeasuring(batch):
            # Also a step that cannot be measured: a new request's prompt must
            # pass through the head for the request to draft at all.
            return True
        if not measurable:
            # Nothing can be learnt from this step: it follows what is known
            # (the nearest batch size measured in both modes), and explores
            # only where nothing is.
            known = verdict if verdict is not None else self._nearest(batch)
            if known is not None:
                return known
        if verdict is not None:
            return verdict
        # Unmeasured here: a larger batch only makes a step more bound by
        # arithmetic, so a loss measured at a smaller batch, or a win at a
        # larger one, decides without trying.
        below = [self._measured(b) for b in self._compared() if b < batch]
        if below and below[-1] is False:
            return False
        above = [self._measured(b) for b in self._compared() if b > batch]
        if above and above[0] is True:
            return True
        spec = self.rates.get((True, batch))
        return spec is None or spec.samples < self.min_samples

    def _by_costs(self, batch: int, predict_trial: Callable[[int], float]) -> bool:
        """With step costs measured and requests gated one by one (`gates_requests`).

        Where a request accepting `trial_rate` of its drafts would not gain by
        the margin (the step costs plus what real steps of each mode cost
        beyond them: on SmolLM2 on a 2-core CPU, any batch of 4 or more; for
        the 4M test model, every batch once a few speculative steps showed
        their overhead), nobody drafts. Elsewhere every request tries, the
        gate stops the drafts of each one they do not pay for, and a batch
        stops drafting once its slowest request would lose (`mix_pays`). The token
        rates of the two modes do not decide here: speculative steps' rate is
        mostly that of the trials the gate stops (on the bench's first, hard
        chats, 111 against 116 tok/s plain: a verdict from the rates, even one
        that stopped only trials below 0.97x, kept the easy chats after them
        from drafting, 0.99x against 1.19x of plain decoding).
        """
        return predict_trial(batch) >= self.margin_at(batch)

    def mix_pays(self, batch: int, gain: float) -> bool:
        """With step costs: the margin trials must promise, asked of the batch's
        slowest request. A batch drains at the pace of its slowest request (a
        request the gate stopped rides along at a token a step, waiting for
        the others' drafts in every step), so the mean gain of a batch says
        little of its time: SmolLM2 in bfloat16 at batch 4, where a 0.8 trial
        promises 1.6x, left one hard chat alone for 52 of 124 steps (0.84x of
        plain decoding); stopping at the first rider gave 0.94-0.98x, and the
        trials of 8 verifications before the gate judged a request still cost
        that much: a request's own acceptance counts from its first
        verification on. Without step costs the measured rates decide alone."""
        if self.predict_trial is None:
            return True
        return gain >= self.margin_at(batch)

    def _remeasuring(self, batch: int) -> bool:
        """Whether speculation, measured losing at this batch size, is being
        measured again; starts a re-measurement when one is due. Its rate moves
        with acceptance, which plain steps cannot see: after `refresh` plain
        steps, `remeasure` speculative ones are owed. They join the earlier
        ones: each request draws its own acceptance, so the verdict is for the
        requests to come, over as many of them as the window holds."""
        if self._owed.get(batch, 0) > 0:
            return True
        if self._plain_since.get(batch, 0) < self.refresh:
            return False
        self._owed[batch] = self.remeasure
        return True

    def _measured(self, batch: int) -> bool | None:
        """Whether speculation beat plain decoding at this batch size (None: not both measured)."""
        spec, plain = self.rates.get((True, batch)), self.rates.get((False, batch))
        # Speculation's few first steps decide nothing: plain steps are measured
        # without a trial where requests stopped drafting on their own (the
        # request gate), and 4 speculative steps of one request turned
        # speculation off for the next ones.
        if (spec is None or plain is None or spec.samples < self.min_samples
                or not plain.samples):
            return None
        return spec.tokens_per_s >= self.margin_at(batch) * plain.tokens_per_s

    def _nearest(self, batch: int) -> bool | None:
        """The verdict at the batch size measured in both modes that is nearest to
        `batch` by ratio (the smaller on a tie); None where none is."""
        compared = self._compared()
        if not compared:
            return None
        nearest = min(compared, key=lambda b: (abs(math.log2(b / batch)), b))
        return self._measured(nearest)

    def margin_at(self, batch: int) -> float:
        """How much faster speculation's decode rate must be at this batch size."""
        return self.margin + self.margin_per_doubling * math.log2(batch)

    def _compared(self) -> list[int]:
        """The batch sizes where both modes are measured, ascending."""
        return sorted(b for s, b in self.rates if s and self._measured(b) is not None)

    def observe(self, speculative: bool, batch: int, tokens: int, seconds: float) -> None:
        if batch <= 0 or tokens <= 0 or seconds <= 0:
            return
        if speculative:
            self._plain_since[batch] = 0
            self._owed[batch] = max(0, self._owed.get(batch, 0) - 1)
        else:
            self._plain_since[batch] = self._plain_since.get(batch, 0) + 1
        rate = self.rates.get((speculative, batch))
        if rate is None:
            rate = self.rates[speculative, batch] = StepRate(self.settle, self.window)
        rate.add(tokens, seconds)


def make_policy(mode: str) -> SpeculationPolicy:
    """The policy of an EngineSettings.speculation mode ("adaptive" or "always")."""
    if mode == "adaptive":
        return AdaptiveSpeculation()
    if mode == "always":
        return SpeculationPolicy()
    raise ValueError(f"unknown speculation mode {mode!r}")
