"""The speculation policy: when an engine with a draft head drafts (pure Python)."""

from __future__ import annotations

import pytest

from esurge.spec_decode.policy import AdaptiveSpeculation, make_policy, step_cost


def feed(policy: AdaptiveSpeculation, speculative: bool, batch: int, steps: int, tokens: int,
         seconds: float) -> None:
    for _ in range(steps):
        policy.observe(speculative, batch, tokens, seconds)


def test_always_drafts_whenever_a_step_has_requests() -> None:
    policy = make_policy("always")
    assert policy.speculate(1) and policy.speculate(64) and not policy.speculate(0)


def test_speculation_is_tried_first_then_plain_decoding() -> None:
    policy = AdaptiveSpeculation(min_samples=3, settle=0)
    assert policy.speculate(4)
    feed(policy, True, 4, 2, 10, 0.01)
    assert policy.speculate(4)  # two steps measured, three wanted
    feed(policy, True, 4, 1, 10, 0.01)
    assert not policy.speculate(4)  # now plain decoding is measured too


@pytest.mark.parametrize(("spec_tokens", "drafts"), [(12, True), (11, False), (8, False)])
def test_speculation_must_win_by_the_margin(spec_tokens: int, drafts: bool) -> None:
    policy = AdaptiveSpeculation(min_samples=1, settle=0, margin=1.2, margin_per_doubling=0)
    feed(policy, True, 4, 5, spec_tokens, 0.01)
    feed(policy, False, 4, 5, 10, 0.01)
    assert policy.speculate(4) is drafts


def test_a_rate_is_tokens_over_seconds_not_a_mean_of_step_rates() -> None:
    policy = AdaptiveSpeculation(settle=0)
    policy.observe(True, 2, 1, 0.001)  # 1,000 tok/s
    policy.observe(True, 2, 9, 0.003)  # 3,000 tok/s
    assert policy.rates[(True, 2)].tokens_per_s == pytest.approx(2500)


def test_the_first_steps_settle_before_they_count() -> None:
    policy = AdaptiveSpeculation(settle=2)
    feed(policy, True, 1, 2, 1, 1.0)  # a fresh process's slow first steps
    assert policy.rates[(True, 1)].samples == 0
    policy.observe(True, 1, 5, 0.001)
    assert policy.rates[(True, 1)].samples == 1
    assert policy.rates[(True, 1)].tokens_per_s == pytest.approx(5000)


def test_an_unmeasured_batch_follows_its_measured_neighbours() -> None:
    lost = AdaptiveSpeculation(min_samples=1, settle=0)
    feed(lost, True, 2, 3, 10, 0.01)
    feed(lost, False, 2, 3, 10, 0.001)
    assert not lost.speculate(8)  # lost at 2: loses at any larger batch
    assert lost.speculate(1)  # nothing says so below: tried
    won = AdaptiveSpeculation(min_samples=1, settle=0)
    feed(won, True, 16, 3, 10, 0.001)
    feed(won, False, 16, 3, 10, 0.01)
    feed(won, True, 4, 5, 1, 1.0)  # measured alone at 4, and badly
    assert won.speculate(4)  # won at 16: wins at any smaller batch


def test_a_step_that_cannot_be_measured_follows_the_nearest_measured_batch() -> None:
    # While a batch fills up every step carries prompt chunks: such steps never
    # count, so exploring there would speculate on every one of them.
    policy = AdaptiveSpeculation(min_samples=1, settle=0, margin=1.0, margin_per_doubling=0)
    assert policy.speculate(20, measurable=False)  # nothing known anywhere: explore
    feed(policy, True, 32, 2, 40, 0.01)
    feed(policy, False, 32, 2, 80, 0.01)  # speculation loses at 32
    assert policy.speculate(20)  # a decode step at 20 may still be measured
    assert not policy.speculate(20, measurable=False)
    feed(policy, True, 1, 2, 4, 0.01)
    feed(policy, False, 1, 2, 1, 0.01)  # and wins alone
    assert policy.speculate(3, measurable=False)  # nearer 1 than 32 by ratio
    assert not policy.speculate(12, measurable=False)
    assert not policy.speculate(32, measurable=False)


def test_a_losing_speculation_is_measured_again_after_refresh_plain_steps() -> None:
    policy = AdaptiveSpeculation(min_samples=1, settle=0, refresh=5, remeasure=2)
    feed(policy, True, 1, 1, 1, 0.01)
    feed(policy, False, 1, 4, 1, 0.001)
    assert not policy.speculate(1)
    feed(policy, False, 1, 1, 1, 0.001)  # the fifth plain step since speculation ran
    assert policy.speculate(1)
    feed(policy, True, 1, 1, 5, 0.01)
    assert policy.speculate(1)  # one more owed
    feed(policy, True, 1, 1, 5, 0.01)
    assert not policy.speculate(1)  # still slower: plain again


def test_larger_batches_need_a_larger_lead() -> None:
    policy = AdaptiveSpeculation(margin=1.05, margin_per_doubling=0.075)
    assert policy.margin_at(1) == pytest.approx(1.05)
    assert policy.margin_at(16) == pytest.approx(1.35)
    for batch in (1, 16):
        feed(policy, True, batch, 16 + 12, 13, 0.01)  # 1,300 tok/s
        feed(policy, False, batch, 16 + 12, 10, 0.01)  # 1,000 tok/s
    assert policy.speculate(1) and not policy.speculate(16)


@pytest.mark.parametrize("kwargs", [{"min_samples": 0}, {"refresh": 0}, {"remeasure": 0},
                                    {"margin": 0.9}, {"margin_per_doubling": -0.1},
                                    {"settle": -1}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveSpeculation(**kwargs)  # type: ignore[arg-type]


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="sometimes"):
        make_policy("sometimes")


def test_a_step_costs_the_span_since_the_step_before_it() -> None:
    # Synchronous: dispatched 2 ms after the previous collect, collected 10 ms later.
    assert step_cost(started=1.002, collected=1.012, last_collected=1.0) == pytest.approx(0.012)
    # Pipelined: dispatched while the previous step still ran (before its
    # collect at 1.0); it costs the 8 ms between the collects, not 12.
    assert step_cost(started=0.996, collected=1.008, last_collected=1.0) == pytest.approx(0.008)
    # After a pause of the loop (or for the first step) only its own time counts.
    assert step_cost(started=2.0, collected=2.01, last_collected=1.0) == pytest.approx(0.01)
    assert step_cost(started=2.0, collected=2.01, last_collected=None) == pytest.approx(0.01)


def test_a_remeasurement_joins_the_earlier_speculative_steps() -> None:
    # Acceptance is mostly a property of the request: one request whose drafts
    # fare well after several that fared badly does not turn speculation on,
    # and one unlucky request after many good ones does not turn it off.
    policy = AdaptiveSpeculation(min_samples=1, settle=0, refresh=5, remeasure=2, window=12)
    feed(policy, True, 1, 10, 1, 0.01)  # 100 tok/s
    feed(policy, False, 1, 5, 1, 0.001)  # 1,000 tok/s
    assert policy.speculate(1)  # five plain steps since speculation ran: measure again
    feed(policy, True, 1, 2, 50, 0.01)  # 5,000 tok/s
    assert policy.rates[(True, 1)].tokens_per_s == pytest.approx((10 + 100) / 0.12)
    assert not policy.speculate(1)  # 917 tok/s over the window: plain still wins
    feed(policy, False, 1, 5, 1, 0.001)
    assert policy.speculate(1)
    feed(policy, True, 1, 2, 50, 0.01)  # the window: 8 slow steps, 4 fast ones
    assert policy.speculate(1)  # 1,733 tok/s: speculation wins
    feed(policy, True, 1, 2, 1, 0.01)  # an unlucky request's steps
    assert policy.speculate(1)  # still 1,733 tok/s over the window
    assert len(policy.rates[(True, 1)].recent) == 12


def test_the_window_must_hold_a_step() -> None:
    with pytest.raises(ValueError, match="window"):
        AdaptiveSpeculation(window=0)


def test_a_new_requests_prompt_starts_the_remeasurement() -> None:
    # Alone, a request that ran a plain step never drafts again: speculation is
    # measured again on the next request, whose prompt must then go through the
    # head (a step that cannot be measured).
    policy = AdaptiveSpeculation(min_samples=1, settle=0, refresh=5, remeasure=2)
    feed(policy, True, 1, 1, 1, 0.01)
    feed(policy, False, 1, 4, 1, 0.001)
    assert not policy.speculate(1, measurable=False)
    feed(policy, False, 1, 1, 1, 0.001)
    assert policy.speculate(1, measurable=False)
    assert policy.speculate(1, measurable=False)  # a longer prompt: still owed
    feed(policy, True, 1, 2, 1, 0.01)
    assert not policy.speculate(1, measurable=False)  # measured, and lost again
