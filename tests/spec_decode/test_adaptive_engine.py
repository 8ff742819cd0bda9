"""Adaptive speculation in a real engine: steps switch between speculative and
plain, and the tokens stay exactly the target's (the bigram target with its
perfect head). The engine schedules asynchronously, as eSurge's default:
its plain steps overlap, its speculative ones do not."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esurge import SamplingParams, eSurge
from esurge.engine.request_output import RequestDelta
from esurge.runner.device_step import model_step, model_step_features
from esurge.runner.steps.plain import record_plain
from esurge.runner.steps.speculative.head_sync import MAX_MOVES
from esurge.runner.steps.speculative.verify import verify_jit
from esurge.spec_decode import proposer
from esurge.spec_decode.policy import AdaptiveSpeculation, SpeculationPolicy
from tests.spec_decode.conftest import BIGRAM_K
from tests.spec_decode.helpers import spec_config
from tests.spec_decode.test_bigram_engine import greedy, greedy_chain, prompts


@pytest.fixture(scope="module")
def adaptive_engine(bigram_dirs: tuple[Path, Path]) -> Iterator[eSurge]:
    target, head = bigram_dirs
    config = spec_config(BIGRAM_K, head, max_num_seqs=32, batched_tokens=64, async_=True)
    llm = eSurge(target, config, show_progress=False, min_token_bucket=32)
    yield llm
    llm.shutdown()


def test_the_default_is_adaptive_with_plain_steps_compiled(adaptive_engine: eSurge) -> None:
    assert isinstance(adaptive_engine.runner.spec.policy, AdaptiveSpeculation)
    assert [kind.name for kind in adaptive_engine.runner.step_kinds] == [
        "speculative", "greedy", "sampled"]


def test_switching_modes_keeps_every_token(adaptive_engine: eSurge,
                                           bigram_dirs: tuple[Path, Path]) -> None:
    from tests.spec_decode.helpers import bigram_next_probs

    probs = bigram_next_probs(bigram_dirs[0])
    runner = adaptive_engine.runner
    assert runner.spec is not None
    # Quick to decide: plain decoding is tried after 2 speculative steps.
    policy = runner.spec.policy = AdaptiveSpeculation(min_samples=2, settle=0)
    jitted: tuple[Any, ...] = (model_step, model_step_features, verify_jit,
                               proposer.propose_first, proposer._propose_rest)
    before = [f._cache_size() for f in jitted]
    overlapped_before = adaptive_engine.loop.core.num_overlapped_steps
    ahead_before = adaptive_engine.loop.core.num_drafts_ahead
    # Four prompts admitted in one step, then decoding together (batch 4 throughout).
    batch = [p[:5] for p in prompts(4, seed=6)]
    outs = adaptive_engine.generate(batch, greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == [greedy_chain(probs, p, 40) for p in batch]
    modes = {speculative for speculative, _ in policy.rates}
    assert modes == {True, False}, "both speculative and plain steps ran"
    stats = runner.spec_stats
    assert stats is not None and stats.num_verifications > 0
    assert runner.spec.unsynced == set()  # every finished request was released
    assert [f._cache_size() for f in jitted] == before  # warm-up compiled both modes
    core = adaptive_engine.loop.core
    assert core.async_scheduling and core.num_overlapped_steps > overlapped_before
    # Speculative steps handed their drafts ahead (pipelined) with nothing compiled.
    assert core.num_drafts_ahead > ahead_before

    # A request alone: the policy measured plain decoding at batch 1 only if
    # plain steps ran there; whatever it chose, the tokens are the target's.
    alone = adaptive_engine.generate([[3, 1, 4]], greedy(12))[0].outputs[0].token_ids
    assert alone == greedy_chain(probs, [3, 1, 4], 12)


def test_a_seeded_sample_takes_no_drafts_and_keeps_its_tokens(
        adaptive_engine: eSurge, bigram_dirs: tuple[Path, Path]) -> None:
    # Which mode a step takes depends on measured timings; a seeded request's
    # tokens must not: under the adaptive policy it samples as plain decoding.
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    runner = adaptive_engine.runner
    assert runner.spec is not None
    runner.spec.policy = AdaptiveSpeculation(min_samples=1, settle=0)
    alone = adaptive_engine.generate([[2, 7, 1]], params)[0].outputs[0]
    crowd = adaptive_engine.generate([*prompts(6, seed=9), [2, 7, 1]],
                                     [greedy(20)] * 6 + [params])[-1].outputs[0]
    with eSurge(bigram_dirs[0], spec_config(None, None), show_progress=False,
                warmup=False) as plain:
        reference = plain.generate([[2, 7, 1]], params)[0].outputs[0]
    assert alone.token_ids == crowd.token_ids == reference.token_ids
    assert alone.num_draft_tokens == crowd.num_draft_tokens == 0


class _Switch(SpeculationPolicy):
    """Plain steps until switched on: requests started before decode plain
    (pipelined) to the end; one started after drafts."""

    def __init__(self) -> None:
        self.on = False

    def speculate(self, batch: int, measurable: bool = True) -> bool:
        return self.on and batch > 0


def test_a_speculative_step_behind_a_plain_one_in_flight(
        adaptive_engine: eSurge, bigram_dirs: tuple[Path, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from esurge.runner import runner as runner_module
    from tests.spec_decode.helpers import bigram_next_probs

    probs = bigram_next_probs(bigram_dirs[0])
    runner = adaptive_engine.runner
    assert runner.spec is not None
    runner.spec.policy = policy = _Switch()
    early = []  # plain steps whose tokens a speculative dispatch read before their collect

    def spy(r: Any, pending: Any) -> Any:
        early.append(pending.host_tokens is None)
        return record_plain(r, pending)

    monkeypatch.setattr(runner_module, "record_plain", spy)
    first = [p[:5] for p in prompts(4, seed=12)]
    late = [2, 7, 1, 8, 2]
    tokens: dict[str, list[int]] = defaultdict(list)
    accepted: dict[str, int] = defaultdict(int)
    started, done = threading.Event(), threading.Semaphore(0)

    def on_output(delta: RequestDelta) -> None:  # on the engine thread
        for sample in delta.outputs:
            tokens[delta.request_id].extend(sample.token_ids)
            accepted[delta.request_id] += sample.num_accepted_tokens
        if len(tokens) == len(first):  # every early request ran a step, all plain
            started.set()
        if delta.finished:
            done.release()

    rewound_before = adaptive_engine.loop.core.num_rewound
    ids = [adaptive_engine.submit(p, greedy(80), on_output) for p in first]
    assert started.wait(30)
    policy.on = True
    ids.append(adaptive_engine.submit(late, greedy(60), on_output))
    for _ in ids:
        assert done.acquire(timeout=60)
    assert [tokens[rid] for rid in ids] == (
        [greedy_chain(probs, p, 80) for p in first] + [greedy_chain(probs, late, 60)])
    assert True in early, "no speculative step was dispatched behind a plain one in flight"
    # The early requests ran plain steps, then were moved back to compute again
    # what their head missed, and drafted like the late one (HeadSync).
    moves = adaptive_engine.loop.core.num_rewound - rewound_before
    assert len(first) <= moves <= MAX_MOVES * len(first)
    assert all(accepted[rid] > 0 for rid in ids)


class _Always(SpeculationPolicy):
    """Speculate on every step, with the draft counts the measured costs choose."""

    adapts_drafts = True


@pytest.mark.parametrize("prior, expected", [(0.0, 1), (1.0, BIGRAM_K)])
def test_draft_counts_follow_the_acceptance(adaptive_engine: eSurge,
                                            bigram_dirs: tuple[Path, Path],
                                            prior: float, expected: int) -> None:
    from esurge.spec_decode.draft_length import Acceptance, CostCurve, DraftLength, StepCosts
    from tests.spec_decode.helpers import bigram_next_probs

    probs = bigram_next_probs(bigram_dirs[0])
    runner = adaptive_engine.runner
    spec = runner.spec
    assert spec is not None and spec.lengths is not None, "warm-up measured the step costs"
    costs = spec.lengths.costs
    assert costs.k == BIGRAM_K and costs.plain(1) > 0
    assert all(costs.speculative(b, d) > 0 for b in (1, 4, 32) for d in range(1, BIGRAM_K + 1))
    # Steps costing 1 + 0.1 per row (the measured ones of this tiny model are
    # within noise of each other), and an acceptance believed nil or certain
    # whatever the steps show: one draft a step is all that can pay in the
    # first case, k in the second.
    batches = (1, 2, 4, 8)
    synthetic = StepCosts(CostCurve(tuple((b, 1 + 0.1 * b) for b in batches)), tuple(
        CostCurve(tuple((b, 1 + 0.1 * b * (d + 1)) for b in batches))
        for d in range(1, BIGRAM_K + 1)))
    measured, policy = spec.lengths, spec.policy
    spec.policy = _Always()
    spec.lengths = DraftLength(synthetic, Acceptance(BIGRAM_K, prior=prior, prior_weight=1e9))
    try:
        _check_draft_counts(adaptive_engine, probs, expected)
    finally:
        spec.lengths, spec.policy = measured, policy


def _check_draft_counts(adaptive_engine: eSurge, probs: Any, expected: int) -> None:
    """Every verification carries `expected` drafts, the tokens stay the target's,
    and nothing compiles."""
    from esurge.runner.steps.speculative import verify

    runner = adaptive_engine.runner
    jitted: tuple[Any, ...] = (model_step, model_step_features, verify_jit,
                               proposer.propose_first, proposer._propose_rest,
                               verify.store_draft_probs)
    before = [f._cache_size() for f in jitted]
    stats_before = runner.spec_stats
    batch = [p[:5] for p in prompts(4, seed=21)]
    outs = adaptive_engine.generate(batch, greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == [greedy_chain(probs, p, 30) for p in batch]
    stats = runner.spec_stats
    assert stats is not None and stats_before is not None
    verifications = stats.num_verifications - stats_before.num_verifications
    drafted = stats.num_draft_tokens - stats_before.num_draft_tokens
    assert verifications > 0
    # Every verification carried the chosen count (fewer only where max_tokens cut it).
    assert expected * verifications >= drafted > (expected - 0.5) * verifications
    assert [f._cache_size() for f in jitted] == before, "warm-up compiled every draft count"
