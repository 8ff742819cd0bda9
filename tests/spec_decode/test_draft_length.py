"""The draft count follows measured step costs and acceptance: more drafts where a
step's extra rows are cheap and drafts are accepted, fewer where they are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from esurge.spec_decode.draft_length import (
    Acceptance,
    CostCurve,
    DraftLength,
    StepCosts,
    batch_trial_rate,
    chain_rate,
    head_acceptance_prior,
)


def test_cost_curve_interpolates_and_extrapolates() -> None:
    curve = CostCurve(((1, 1.0), (4, 4.0), (8, 6.0)))
    assert curve.at(1) == 1.0 and curve.at(8) == 6.0
    assert curve.at(2) == pytest.approx(2.0)
    assert curve.at(6) == pytest.approx(5.0)
    assert curve.at(16) == pytest.approx(10.0)  # the last slope, 0.5 a request
    assert CostCurve(((4, 2.0),)).at(1) == 2.0 == CostCurve(((4, 2.0),)).at(9)


@pytest.mark.parametrize("points", [(), ((2, 1.0), (1, 1.0)), ((1, 1.0), (1, 2.0)),
                                    ((0, 1.0),), ((1, -1.0),)])
def test_cost_curve_refuses_bad_points(points: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(ValueError, match="points"):
        CostCurve(points)


def test_acceptance_counts_the_drafts_actually_tested() -> None:
    acc = Acceptance(k=4, prior=0.5, prior_weight=1.0, decay=1.0)
    # 4 drafts, 2 accepted: drafts 1 and 2 accepted, 3 tested and refused, 4 never tested.
    acc.record([(4, 2)])
    assert acc.reached == [1.0, 1.0, 1.0, 0.0]
    assert acc.accepted == [1.0, 1.0, 0.0, 0.0]
    # Each position shrinks towards the estimate before it (position 1: the prior).
    assert acc.rate(1) == pytest.approx((1 + 0.5) / 2)
    assert acc.rate(2) == pytest.approx((1 + 0.75) / 2)
    assert acc.rate(3) == pytest.approx((0 + 0.875) / 2)
    assert acc.rate(4) == pytest.approx(acc.rate(3))  # untested: as the one before
    assert acc.expected_tokens(0) == 1.0
    assert acc.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75 * 0.875)


def test_acceptance_refuses_positions_outside_the_drafts() -> None:
    acc = Acceptance(k=4)
    for position in (0, 5):
        with pytest.raises(ValueError, match=r"position must be in 1\.\.4"):
            acc.rate(position)
    with pytest.raises(ValueError, match=r"drafts must be in 0\.\.4"):
        acc.expected_tokens(5)


def test_positions_never_drafted_are_assumed_to_accept_as_the_one_before() -> None:
    # A pessimistic prior (0.3) and a head whose single drafts are mostly accepted:
    # the later positions follow position 1, so longer chains get tried.
    acc = Acceptance(k=4, prior=0.3, decay=1.0)
    for _ in range(40):
        acc.record([(1, 1), (1, 1), (1, 1), (1, 0)])
    assert acc.rate(1) > 0.7
    assert [acc.rate(j) for j in (2, 3, 4)] == pytest.approx([acc.rate(1)] * 3)
    lengths = DraftLength(_costs(1.0, 0.01, 0.05), acc)
    assert lengths.best(1) == 4
    # Once position 2 is measured refusing, it is no longer assumed good.
    for _ in range(40):
        acc.record([(4, 1)])
    assert acc.rate(2) < 0.2 and lengths.best(1) == 1


def test_acceptance_forgets_old_steps() -> None:
    acc = Acceptance(k=1, prior=0.5, prior_weight=1.0, decay=0.5)
    for _ in range(20):
        acc.record([(1, 1)])
    assert acc.rate(1) > 0.8
    for _ in range(20):
        acc.record([(1, 0)])
    assert acc.rate(1) < 0.2


def _costs(plain: float, per_row: float, per_pass: float, k: int = 4) -> StepCosts:
    """Steps whose cost is `plain` + per_row per extra row + per_pass per head pass."""
    batches = (1, 2, 4, 8)
    return StepCosts(
        CostCurve(tuple((b, plain + per_row * (b - 1)) for b in batches)),
        tuple(CostCurve(tuple((b, plain + per_row * (b * (d + 1) - 1) + per_pass * d)
                              for b in batches)) for d in range(1, k + 1)))


def test_more_drafts_where_rows_are_cheap_and_drafts_accepted() -> None:
    cheap_rows = DraftLength(_costs(1.0, 0.01, 0.05), Acceptance(4, prior=0.9))
    assert cheap_rows.best(1) == 4
    assert cheap_rows.predicted_gain(1) > 2.0
    poor = DraftLength(_costs(1.0, 0.01, 0.05), Acceptance(4, prior=0.2))
    assert poor.best(1) == 1
    dear_rows = DraftLength(_costs(1.0, 1.0, 0.05), Acceptance(4, prior=0.9))
    assert dear_rows.best(8) == 1 and dear_rows.predicted_gain(8) < 1.0


def test_overhead_learnt_from_measured_steps_shortens_nothing_it_should_not() -> None:
    lengths = DraftLength(_costs(1.0, 0.01, 0.05), Acceptance(4, prior=0.9))
    before = lengths.predicted_gain(1)
    for _ in range(100):
        lengths.observe(1, 4, lengths.costs.speculative(1, 4) + 1.0)
    assert lengths.overhead(1) == pytest.approx(1.0, rel=1e-3)
    assert lengths.predicted_gain(1) < before


def test_chain_rate_inverts_the_mean_length() -> None:
    a = chain_rate(3.0, 4)
    assert sum(a ** j for j in range(5)) == pytest.approx(3.0, rel=1e-6)
    assert chain_rate(1.0, 4) == pytest.approx(0.0, abs=1e-9)
    assert chain_rate(9.0, 4) == pytest.approx(1.0, abs=1e-9)


def test_prior_comes_from_the_heads_recorded_evaluation(tmp_path: Path) -> None:
    assert head_acceptance_prior(tmp_path, 4) == 0.6
    (tmp_path / "training_info.json").write_text(
        '{"eval": {"k": 4, "mean_acceptance_length": 3.0}}')
    assert head_acceptance_prior(tmp_path, 4) == pytest.approx(chain_rate(3.0, 4))


def test_a_trial_bets_less_on_a_larger_batch() -> None:
    # One request may well be easy; a batch's mean acceptance is bet on
    # 1/sqrt(batch) as far above the head's measured mean.
    assert batch_trial_rate(0.8, 0.6, 1) == pytest.approx(0.8)
    assert batch_trial_rate(0.8, 0.6, 4) == pytest.approx(0.7)
    assert batch_trial_rate(0.8, 0.6, 16) == pytest.approx(0.65)
    # A head measured above the trial's bet keeps its own mean at every size.
    assert batch_trial_rate(0.5, 0.9, 4) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="batch"):
        batch_trial_rate(0.8, 0.6, 0)
