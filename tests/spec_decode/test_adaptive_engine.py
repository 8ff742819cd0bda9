"""Adaptive speculation in a real engine: steps switch between speculative and
plain, and the tokens stay exactly the target's (the bigram target with its
perfect head)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esurge import SamplingParams, eSurge
from esurge.runner.device_step import model_step, model_step_features
from esurge.runner.steps.speculative.verify import verify_jit
from esurge.spec_decode import proposer
from esurge.spec_decode.policy import AdaptiveSpeculation
from tests.spec_decode.conftest import BIGRAM_K
from tests.spec_decode.helpers import spec_config
from tests.spec_decode.test_bigram_engine import greedy, greedy_chain, prompts


@pytest.fixture(scope="module")
def adaptive_engine(bigram_dirs: tuple[Path, Path]) -> Iterator[eSurge]:
    target, head = bigram_dirs
    config = spec_config(BIGRAM_K, head, max_num_seqs=32, batched_tokens=64)
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
