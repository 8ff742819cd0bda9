"""Requests stop drafting on their own acceptance; the adaptive policy lets every
request try where a request that drafts well would gain, and nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest

from esurge.spec_decode.draft_length import Acceptance, DraftLength
from esurge.spec_decode.policy import AdaptiveSpeculation
from esurge.spec_decode.request_gate import RequestGate
from tests.spec_decode.test_draft_length import _costs


def _lengths(prior: float = 0.6) -> DraftLength:
    # A plain step of 1 request costs 1.0, a step with one draft 1.3, with four 2.2.
    return DraftLength(_costs(1.0, 0.1, 0.2), Acceptance(4, prior=prior))


def test_a_request_whose_drafts_are_refused_stops_after_min_verifications() -> None:
    lengths, gate = _lengths(), RequestGate(min_verifications=10, margin=1.0)
    for _ in range(10):
        assert gate.pays("bad", 1, lengths)  # too few verifications to judge
        gate.record("bad", 4, 0, lengths)
        gate.record("good", 4, 4, lengths)
    # Its first drafts' acceptance shrinks from the engine's 0.6 to 0.17:
    # 1.17 tokens a step for 1.3 seconds, against a plain step's 1 for 1.
    assert not gate.pays("bad", 1, lengths)
    assert gate.pays("good", 1, lengths)
    own = gate.acceptance_of("good")
    assert own is not None and own.expected_tokens(4) > 4.0
    gate.release(["bad", "good"])
    assert gate.acceptance_of("good") is None and gate.pays("bad", 1, lengths)


def test_the_gate_weighs_a_request_against_the_batch_sizes_costs() -> None:
    # Half its drafts accepted: pays alone, not at 8 requests, where each extra
    # row costs a fifth of a plain step.
    lengths = DraftLength(_costs(1.0, 0.2, 0.05), Acceptance(4, prior=0.5))
    gate = RequestGate(min_verifications=4)
    for accepted in (1, 0) * 4:
        gate.record("r", 1, accepted, lengths)
    assert gate.pays("r", 1, lengths) and not gate.pays("r", 8, lengths)


def test_the_gate_weighs_what_plain_steps_cost_beyond_their_timing() -> None:
    lengths, gate = _lengths(), RequestGate(min_verifications=10, margin=1.0)
    for step in range(40):
        gate.record("r", 1, int(step % 5 == 0), lengths)  # a fifth of its drafts accepted
    # About 1.2 tokens for 1.3 seconds against a plain step's 1 for 1: stop ...
    assert not gate.pays("r", 1, lengths)
    for _ in range(40):
        lengths.observe(1, 0, lengths.costs.plain(1) + 0.5)
    # ... unless plain steps really take 1.5.
    assert gate.pays("r", 1, lengths)


def test_by_default_a_request_stops_only_clearly_short_of_break_even() -> None:
    # Stopping is for good while drafting on can still stop later, and a
    # request's acceptance moves over its answer: ten refused verifications
    # (1.17 tokens for 1.3 seconds against a plain step's 1 for 1: 0.90x)
    # are not yet enough, twenty (0.85x) are.
    lengths, gate = _lengths(), RequestGate(min_verifications=10)
    for _ in range(10):
        gate.record("r", 4, 0, lengths)
    assert gate.pays("r", 1, lengths)
    for _ in range(10):
        gate.record("r", 4, 0, lengths)
    assert not gate.pays("r", 1, lengths)


def _dear_lengths(prior: float) -> DraftLength:
    # A step with one draft costs 1.5 plain ones (SmolLM2 bf16 at batch 1 on a
    # 2-core CPU: 1.6-1.7): a request must accept 35% of its first drafts to
    # reach the gate's 0.9.
    return DraftLength(_costs(1.0, 0.1, 0.4), Acceptance(4, prior=prior))


def test_a_request_stops_after_two_refusals_where_recent_requests_drafted_badly() -> None:
    # The engine-wide estimate (15% of first drafts accepted, as on random-token
    # prompts) is the prior of the request's own: two refused verifications
    # leave at most 29% within the gate's confidence, short of 35%.
    lengths, gate = _dear_lengths(0.15), RequestGate()
    gate.record("r", 2, 0, lengths)
    assert gate.pays("r", 1, lengths)  # one verification is not enough to judge
    gate.record("r", 2, 0, lengths)
    own = gate.acceptance_of("r")
    assert own is not None and gate.optimistic(own).rate(1) == pytest.approx(0.286, abs=1e-3)
    assert not gate.pays("r", 1, lengths)
    # Without the early verdict it drafts until min_verifications.
    patient = RequestGate(early_verifications=8)
    for step in range(8):
        assert patient.pays("r", 1, lengths), step
        patient.record("r", 2, 0, lengths)
    assert not patient.pays("r", 1, lengths)


def test_where_recent_requests_drafted_well_a_request_gets_its_whole_trial() -> None:
    # 60% engine-wide (chats): seven straight refusals still leave 41% within
    # the gate's confidence, so the request drafts on until min_verifications
    # judges it by its mean (20%: 0.8x).
    lengths, gate = _dear_lengths(0.6), RequestGate()
    for step in range(8):
        assert gate.pays("r", 1, lengths), step
        gate.record("r", 2, 0, lengths)
    assert not gate.pays("r", 1, lengths)
    # One accepted draft in three verifications keeps a request drafting even
    # where recent requests drafted badly.
    lengths = _dear_lengths(0.15)
    for accepted in (0, 1, 0):
        gate.record("s", 2, accepted, lengths)
    assert gate.pays("s", 1, lengths)


@pytest.mark.parametrize("kwargs", [{"min_verifications": 0}, {"margin": 0.0},
                                    {"prior_weight": -1.0}, {"early_verifications": 0},
                                    {"confidence": -1.0}])
def test_bad_gate_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RequestGate(**kwargs)  # type: ignore[arg-type]


def test_both_modes_learn_what_their_measured_parts_miss() -> None:
    lengths = _lengths()
    plain_rate = lengths.rate(1, 0)
    for _ in range(200):
        lengths.observe(1, 0, lengths.costs.plain(1) + 0.5)
    # A speculative step of the same batch pays the same host work.
    assert lengths.plain_overhead(1) == pytest.approx(0.5, rel=1e-3)
    assert lengths.overhead(1) == pytest.approx(0.5, rel=1e-3)
    assert lengths.rate(1, 0) == pytest.approx(plain_rate / 1.5)


def test_the_draft_count_follows_the_requests_own_acceptance() -> None:
    lengths = DraftLength(_costs(1.0, 0.3, 0.05), Acceptance(4, prior=0.3))
    assert lengths.best(1) == 1  # the engine-wide estimate: one draft
    easy = Acceptance(4, prior=0.95)
    assert lengths.best(1, [easy]) == 4
    assert lengths.predicted_gain(1, [easy]) > lengths.predicted_gain(1)


def _gated_policy(trial_gain: float) -> AdaptiveSpeculation:
    policy = AdaptiveSpeculation(min_samples=2, settle=0, margin=1.05, margin_per_doubling=0.0)
    policy.predict_trial = lambda batch: trial_gain if batch == 1 else 0.8
    return policy


def test_requests_try_only_where_a_good_request_would_gain() -> None:
    policy = _gated_policy(1.3)
    assert policy.speculate(1) and policy.speculate(1, measurable=False)
    assert not policy.speculate(4) and not policy.speculate(4, measurable=False)
    assert not _gated_policy(1.0).speculate(1)  # short of the margin


def test_with_step_costs_the_rates_do_not_stop_trials() -> None:
    policy = _gated_policy(1.3)
    for _ in range(20):
        policy.observe(True, 1, 1, 1.0)  # trials the gate stopped: slow
        policy.observe(False, 1, 40, 1.0)
    assert policy.speculate(1)  # the next request tries all the same


def test_a_verdict_needs_min_samples_speculative_steps() -> None:
    policy = AdaptiveSpeculation(min_samples=3, settle=0, margin_per_doubling=0.0)
    policy.observe(True, 1, 1, 1.0)
    for _ in range(5):
        policy.observe(False, 1, 10, 1.0)  # plain steps of requests that stopped drafting
    assert policy.speculate(1)  # one speculative step decides nothing yet
    for _ in range(2):
        policy.observe(True, 1, 1, 1.0)
    assert not policy.speculate(1)


def test_requests_of_a_head_that_guesses_badly_stop_drafting_in_the_engine(
        bigram_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    from esurge import eSurge
    from esurge.spec_decode.config import EagleLayout
    from tests.spec_decode.helpers import bigram_next_probs, random_head, spec_config
    from tests.spec_decode.test_bigram_engine import greedy, greedy_chain

    target = bigram_dirs[0]
    head = random_head(target, tmp_path / "head", EagleLayout.EAGLE1, seed=5)
    probs = bigram_next_probs(target)
    config = spec_config(3, head, max_num_seqs=32, batched_tokens=64, async_=True)
    # The shared engines' shapes: every program is already compiled.
    with eSurge(target, config, show_progress=False, warmup=False, min_token_bucket=32) as llm:
        spec = llm.runner.spec
        assert spec is not None and spec.policy.gates_requests
        # Costs in seconds, far above the real steps' (no overhead is learnt): a
        # request accepting 80% of its drafts would gain 1.5x alone, one that
        # accepts none loses.
        spec.calibrate(_costs(1.0, 0.1, 0.2, k=3))
        outs = [llm.generate([p], greedy(60))[0].outputs[0]
                for p in ([3, 1, 4], [2, 7, 1], [5, 9, 2])]
        assert spec.unsynced == set()  # released with the requests
    for p, out in zip(([3, 1, 4], [2, 7, 1], [5, 9, 2]), outs, strict=True):
        assert out.token_ids == greedy_chain(probs, p, 60)
        # Each tried (the policy lets every request start at batch 1) and stopped
        # after the gate's 8 verifications of at most 3 drafts.
        assert 0 < out.num_draft_tokens <= 8 * 3
        assert out.num_accepted_tokens < out.num_draft_tokens


def test_a_few_slow_steps_do_not_move_the_overheads() -> None:
    lengths = _lengths()
    spec_cost = lengths.costs.speculative(1, 4)
    for step in range(40):
        lengths.observe(1, 4, spec_cost + 0.1)
        if step % 10 == 0:  # a collector's pause now and then
            lengths.observe(1, 4, spec_cost + 50.0)
    assert lengths.overhead(1) == pytest.approx(0.1)
    for _ in range(40):  # a lasting change does
        lengths.observe(1, 4, spec_cost + 0.3)
    assert lengths.overhead(1) == pytest.approx(0.3)


def test_a_batch_drafts_while_its_slowest_request_pays() -> None:
    lengths = DraftLength(_costs(1.0, 0.1, 0.2), Acceptance(4, prior=0.6))
    gate, trial = RequestGate(min_verifications=4), Acceptance(4, prior=0.8)
    policy = AdaptiveSpeculation(margin=1.05, margin_per_doubling=0.075)
    assert policy.mix_pays(2, 0.5)  # without step costs the measured rates decide
    policy.predict_trial = lambda batch: lengths.predicted_gain(batch, (trial,))

    def pays(*req_ids: str, drafting: tuple[str, ...] | None = None) -> bool:
        gain = gate.mix_gain(req_ids, set(req_ids if drafting is None else drafting),
                             lengths, trial)
        return policy.mix_pays(len(req_ids), gain)

    for _ in range(16):
        gate.record("good", 3, 3, lengths)
    # Two requests in trial promise 1.4x at batch 2 (the margin there: 1.125) ...
    assert pays("new", "other")
    # ... but not beside a request that takes no drafts: that rider gains a
    # token a step and waits for the other's drafts in every one.
    assert not pays("new", "rider", drafting=("new",))
    # The slowest request decides: a good one does not carry a new one ...
    for _ in range(16):
        gate.record("good2", 3, 3, lengths)
    assert (gate.mix_gain(["good", "new"], {"good", "new"}, lengths, trial)
            < gate.mix_gain(["good", "good2"], {"good", "good2"}, lengths, trial))
    # ... and one refused verification (0 of 3 drafts, the gate's estimate of
    # its first draft down from the engine's 0.6 to 0.48) stops the batch,
    # long before the gate would judge the request alone.
    gate.record("bad", 3, 0, lengths)
    assert not pays("good", "bad") and gate.pays("bad", 2, lengths)


def test_the_slowest_gain_is_that_requests_tokens_over_the_step() -> None:
    lengths = DraftLength(_costs(1.0, 0.1, 0.2), Acceptance(4, prior=0.6))
    fast, slow = Acceptance(4, prior=0.9), Acceptance(4, prior=0.3)
    drafts = lengths.best(2, [fast, slow])
    step = lengths.costs.speculative(2, drafts)
    assert lengths.slowest_gain(2, [fast, slow]) == pytest.approx(
        slow.expected_tokens(drafts) * lengths.costs.plain(2) / step)
    # A rider gains one token a step.
    assert lengths.slowest_gain(2, [fast], riders=1) == pytest.approx(
        lengths.costs.plain(2) / lengths.costs.speculative(2, lengths.best(2, [fast], riders=1)))


def test_a_batch_whose_mix_loses_stops_drafting_in_the_engine(
        bigram_dirs: tuple[Path, Path]) -> None:
    from esurge import SamplingParams, eSurge
    from tests.spec_decode.helpers import bigram_next_probs, spec_config
    from tests.spec_decode.test_bigram_engine import greedy, greedy_chain

    target, head = bigram_dirs  # a perfect head: alone, its drafts always pay
    config = spec_config(3, head, max_num_seqs=32, batched_tokens=64, async_=True)
    with eSurge(target, config, show_progress=False, warmup=False, min_token_bucket=32) as llm:
        spec = llm.runner.spec
        assert spec is not None
        spec.calibrate(_costs(1.0, 0.1, 0.2, k=3))  # as in the test above
        # A seeded sample takes no drafts under the adaptive policy: it rides along.
        rider = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
        drafting, riding = llm.generate([[3, 1, 4], [2, 7, 1]], [greedy(40), rider])
        alone = llm.generate([[3, 1, 4]], greedy(40))[0].outputs[0]
    assert drafting.outputs[0].token_ids == greedy_chain(bigram_next_probs(target), [3, 1, 4], 40)
    assert riding.outputs[0].num_draft_tokens == 0
    # Beside a rider it does not draft: the request decodes plainly (had it been
    # admitted a step before the rider, the one proposal it made alone would be
    # verified first); alone, its drafts pay and it drafts to the end.
    assert drafting.outputs[0].num_draft_tokens <= 3
    assert alone.num_draft_tokens > 20


def test_prompts_pass_through_the_head_only_where_the_filling_batch_would_draft(
        bigram_dirs: tuple[Path, Path]) -> None:
    from esurge import SamplingParams, eSurge
    from esurge.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
    from tests.spec_decode.helpers import spec_config

    target, head = bigram_dirs
    config = spec_config(3, head, max_num_seqs=32, batched_tokens=64, async_=True)
    with eSurge(target, config, show_progress=False, warmup=False, min_token_bucket=32) as llm:
        spec = llm.runner.spec
        assert spec is not None
        # Trials pay up to 3 requests (1.22x against a margin of 1.17 there).
        spec.calibrate(_costs(1.0, 0.1, 0.2, k=3))
        params = SamplingParams(temperature=0, max_tokens=8)

        def admitting(new: int, waiting: int) -> SchedulerOutput:
            reqs = [NewRequestData(f"r{i}", [1] * 20, params, ((0,),), 0, None, ())
                    for i in range(new)]
            scheduled = {r.req_id: 20 for r in reqs}
            return SchedulerOutput(reqs, CachedRequestData(), scheduled, 20 * new, {}, set(),
                                   set(), 4, num_waiting_reqs=waiting)

        assert spec.speculates(admitting(3, 0)) and spec.speculates(admitting(2, 1))
        # Four requests each as easy as one trial bets on (0.8 a position) would
        # pay (1.27x against 1.2), but four chats' mean acceptance is bet on
        # only half as far above the head's 0.6 (batch_trial_rate: 0.7, 1.16x).
        assert not spec.speculates(admitting(3, 1))
        # Three prompts of a batch filling to eight: the head would read them for nothing.
        assert not spec.speculates(admitting(3, 5))
        assert not spec.speculates(admitting(3, 100))


def test_a_rider_makes_fewer_drafts_pay() -> None:
    # Each draft adds a row for every request, and a rider gains nothing from it.
    lengths = DraftLength(_costs(1.0, 0.1, 0.2), Acceptance(4, prior=0.6))
    request = Acceptance(4, prior=0.8)
    assert (lengths.best(2, [request]), lengths.best(2, [request], riders=1)) == (2, 1)
    one_draft = lengths.costs.speculative(2, 1)
    assert lengths.rate(2, 1, [request], riders=1) == pytest.approx(
        (request.expected_tokens(1) + 1) / one_draft)
