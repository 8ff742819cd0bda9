"""What real steps cost beyond warm-up's measured parts, by batch size: a plain
step's per batch size, a speculative step's as an extra over it."""

from __future__ import annotations

import pytest

from esurge.spec_decode.draft_length import Acceptance, DraftLength
from esurge.spec_decode.overheads import StepOverheads
from tests.spec_decode.test_draft_length import _costs


def test_each_batch_size_keeps_its_own_plain_overhead() -> None:
    overheads = StepOverheads()
    assert overheads.plain(1) == 0.0 and overheads.speculative(4) == 0.0  # nothing measured
    for _ in range(5):
        overheads.observe(1, False, 0.3)
        overheads.observe(4, False, 2.5)
    assert overheads.plain(1) == pytest.approx(0.3) and overheads.plain(4) == pytest.approx(2.5)
    # An unmeasured size takes the nearest by ratio, the smaller on a tie.
    assert overheads.plain(2) == pytest.approx(0.3)
    assert overheads.plain(3) == pytest.approx(2.5) and overheads.plain(32) == pytest.approx(2.5)
    overheads.observe(16, False, 4.0)  # a size measured later is nearer to some
    assert overheads.plain(32) == pytest.approx(4.0) and overheads.plain(6) == pytest.approx(2.5)


def test_a_speculative_step_costs_its_extra_over_the_plain_overhead_of_its_batch() -> None:
    overheads = StepOverheads()
    for _ in range(5):
        overheads.observe(1, False, 0.3)
        overheads.observe(1, True, 1.2)  # 0.9 more than a plain step of 1
        overheads.observe(4, False, 2.5)
    assert overheads.speculative(1) == pytest.approx(1.2)
    assert overheads.speculative(4) == pytest.approx(3.4)


def test_busy_plain_steps_of_a_larger_batch_do_not_make_speculation_look_cheap_there() -> None:
    # Host work grows with the batch and both modes pay it. Counted for plain
    # steps alone (plain steps of 4 beside speculative ones of 1, as one
    # figure per mode did), speculation at 4 looked 1.43x better than plain
    # decoding, past the adaptive policy's margin of 1.2 there, and trials ran
    # that lost (SmolLM2 bf16, random-token prompts: 0.87x).
    lengths = DraftLength(_costs(1.0, 0.25, 0.1), Acceptance(4, prior=0.7))
    for _ in range(20):
        lengths.observe(1, 0, lengths.costs.plain(1) + 0.05)
        lengths.observe(1, 4, lengths.costs.speculative(1, 4) + 0.25)
    for _ in range(40):
        lengths.observe(4, 0, lengths.costs.plain(4) + 1.0)
    assert lengths.plain_overhead(4) == pytest.approx(1.0)
    assert lengths.overhead(4) == pytest.approx(1.2)
    drafts = lengths.best(4)
    plain_side_only = (4 * lengths.acceptance.expected_tokens(drafts)
                       / (lengths.costs.speculative(4, drafts) + 0.25)) / lengths.rate(4, 0)
    assert lengths.predicted_gain(4) < 1.2 < plain_side_only


def test_a_few_slow_steps_do_not_move_an_overhead() -> None:
    overheads = StepOverheads(window=9)
    for step in range(30):
        overheads.observe(2, False, 50.0 if step % 10 == 0 else 0.2)
    assert overheads.plain(2) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="window"):
        StepOverheads(window=0)
