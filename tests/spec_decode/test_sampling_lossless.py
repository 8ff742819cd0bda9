"""Under sampling, speculation keeps the target's distribution exactly: the empirical
distribution of tokens emitted through verified runs matches the bigram target's
exact marginals (chi-square, fixed seeds, so the outcome is deterministic)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from esurge import SamplingParams, eSurge
from tests.spec_decode.helpers import bigram_next_probs

# Chi-square critical value for 15 degrees of freedom at p = 0.001.
CHI2_CRIT_DF15 = 37.70
NUM_SAMPLES = 1200
TEMPERATURE = 2.0


def chi_square(tokens: list[int], probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    expected = len(tokens) * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_emitted_tokens_follow_the_target_distribution(bigram_engine: eSurge,
                                                       bigram_dirs: tuple[Path, Path]) -> None:
    probs = bigram_next_probs(bigram_dirs[0], TEMPERATURE)
    prompt = [5, 9, 14]
    before = bigram_engine.runner.spec_stats
    outs = bigram_engine.generate([prompt] * NUM_SAMPLES, [
        SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=3, ignore_eos=True)
        for seed in range(NUM_SAMPLES)])
    after = bigram_engine.runner.spec_stats
    tokens = np.array([o.outputs[0].token_ids for o in outs])  # [N, 3]
    first = probs[prompt[-1]]
    second = first @ probs
    third = second @ probs
    # Token 1 comes from the prefill; tokens 2 and 3 from verified drafts.
    assert chi_square(tokens[:, 0].tolist(), first) < CHI2_CRIT_DF15
    assert chi_square(tokens[:, 1].tolist(), second) < CHI2_CRIT_DF15
    assert chi_square(tokens[:, 2].tolist(), third) < CHI2_CRIT_DF15
    assert before is not None and after is not None
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    # Both acceptance and rejection happened many times.
    assert 0.2 * drafted < accepted < 0.9 * drafted
