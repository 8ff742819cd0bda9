"""A trial of new requests bets on how recent requests' first verifications went:
where they drafted poorly a batch of 4 stops trying and a lone request bets
lower, where they drafted as the head's trainer recorded nothing changes."""

from __future__ import annotations

import pytest

from esurge.spec_decode.draft_length import (
    Acceptance,
    CostCurve,
    DraftLength,
    StepCosts,
    batch_trial_rate,
)
from esurge.spec_decode.trial_bet import TrialBets

PRIOR = 0.575  # SmolLM2's head: its recorded 2.21 tokens a verification at k = 4
MARGIN_AT_4 = 1.2  # AdaptiveSpeculation.margin_at(4)


def smollm2_costs() -> DraftLength:
    """SmolLM2 bf16 on a 2-core Zen 5 as warm-up measured it (ms): plain, then
    1..4 drafts, at batch 1, 2, 4 and 8."""
    table = {1: (5.62, 6.61, 9.22, 9.22, 9.22), 2: (5.62, 7.21, 9.22, 9.99, 10.46),
             4: (5.62, 8.74, 10.69, 13.17, 14.09), 8: (6.22, 15.08, 18.06, 21.33, 25.0)}

    def curve(column: int) -> CostCurve:
        return CostCurve(tuple((b, row[column] / 1e3) for b, row in table.items()))

    costs = StepCosts(curve(0), tuple(curve(d) for d in range(1, 5)))
    return DraftLength(costs, Acceptance(4, prior=PRIOR))


def trials_of(bets: TrialBets, requests: int, accepted: int, verifications: int = 2) -> None:
    """`requests` requests each verifying 4 drafts `verifications` times, `accepted` matching."""
    for _ in range(requests):
        for n in range(1, verifications + 1):
            bets.record(n, 4, accepted)


def test_a_fresh_engine_bets_on_the_heads_recorded_rate() -> None:
    bets = TrialBets(smollm2_costs(), 0.8, PRIOR)
    assert bets.centre() == pytest.approx(PRIOR, abs=0.01)
    # Alone: the policy's trial rate; a batch of 4 half as far above the centre.
    assert bets.bet(1).prior == pytest.approx(0.8, abs=0.01)
    assert bets.bet(4).prior == pytest.approx(
        batch_trial_rate(bets.centre() + 0.8 - PRIOR, bets.centre(), 4))
    assert bets.bet(4).prior == pytest.approx((0.8 + PRIOR) / 2, abs=0.01)
    assert bets.gain(4) == pytest.approx(
        bets.lengths.predicted_gain(4, (Acceptance(4, prior=bets.bet(4).prior),)))


def test_poor_trials_lower_every_bet() -> None:
    bets = TrialBets(smollm2_costs(), 0.8, PRIOR)
    alone, before = bets.gain(1), bets.gain(4)
    assert before > 1.1  # near the margin, 1.2: real steps' overheads moved it across
    trials_of(bets, requests=6, accepted=0)  # random-token prompts: nothing accepted
    centre = bets.centre()
    assert centre < 0.2
    assert bets.gain(4) < 1.0 < MARGIN_AT_4  # a loss even before the margin
    # Alone a request still bets the recorded spread above the centre.
    assert bets.bet(1).prior == pytest.approx(centre + 0.8 - PRIOR, abs=0.01)
    assert bets.gain(1) < alone - 0.3


def test_a_head_recorded_above_the_trial_rate_bets_on_the_centre() -> None:
    bets = TrialBets(smollm2_costs(), 0.8, 0.9)
    assert bets.bet(1).prior == pytest.approx(bets.centre()) == pytest.approx(0.9, abs=0.01)


def test_each_request_counts_alike() -> None:
    # Two easy requests verifying 40 times each and six hard ones stopped after
    # two: per verification the drafts did well, per request they did not.
    bets = TrialBets(smollm2_costs(), 0.8, PRIOR)
    engine_wide = Acceptance(4, prior=PRIOR)
    for _ in range(2):
        for n in range(1, 41):
            bets.record(n, 4, 4)
            engine_wide.record([(4, 4)])
    for _ in range(6):
        for n in range(1, 3):
            bets.record(n, 4, 0)
            engine_wide.record([(4, 0)])
    assert engine_wide.rate(1) > 0.8
    assert bets.centre() < PRIOR
    assert bets.trials.reached[0] == pytest.approx(16, rel=0.2)  # two a request


def test_trials_fade_over_plain_steps() -> None:
    bets = TrialBets(smollm2_costs(), 0.8, PRIOR)
    before = bets.gain(4)
    trials_of(bets, requests=6, accepted=0)
    low = bets.centre()
    for _ in range(100):
        bets.idle()
    assert low < bets.centre() < PRIOR  # a little back towards the recorded rate
    for _ in range(10_000):
        bets.idle()
    assert bets.centre() == pytest.approx(PRIOR, abs=0.01)
    assert bets.gain(4) == pytest.approx(before, abs=0.02)  # a batch of 4 bets as at first


@pytest.mark.parametrize(("field", "kwargs"), [
    ("trial_rate", {"trial_rate": 1.5}), ("prior", {"prior": -0.1}),
    ("verifications", {"verifications": 0}), ("idle_decay", {"idle_decay": 0.0}),
])
def test_bad_settings_are_refused(field: str, kwargs: dict[str, float]) -> None:
    settings = {"trial_rate": 0.8, "prior": PRIOR, **kwargs}
    with pytest.raises(ValueError, match=field):
        TrialBets(smollm2_costs(), **settings)  # type: ignore[arg-type]


def test_fade_refuses_a_factor_outside_zero_to_one() -> None:
    acceptance = Acceptance(4)
    for factor in (0.0, 1.5):
        with pytest.raises(ValueError, match="factor"):
            acceptance.fade(factor)
