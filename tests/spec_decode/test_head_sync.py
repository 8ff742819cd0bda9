"""A request that decoded plain steps drafts again once drafting pays at its
batch size: it is moved back to where its head's cache stops and computes those
tokens again through the head (esurge/runner/steps/speculative/head_sync.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from esurge import SamplingParams, eSurge
from tests.spec_decode.conftest import BIGRAM_K
from tests.spec_decode.helpers import AloneOnly, bigram_next_probs, spec_config
from tests.spec_decode.test_bigram_engine import greedy_chain


def _run(target: Path, head: Path, async_: bool, resync: bool, prompts: bool = True
         ) -> tuple[list[list[int]], list[int], int, int, int]:
    # The shared bigram engine's shapes: every program is already compiled.
    config = spec_config(BIGRAM_K, head, max_num_seqs=32, batched_tokens=64, async_=async_)
    rng = np.random.default_rng(3)
    batch = [rng.integers(0, 16, size=n).tolist() for n in (9, 12, 15, 20)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (60, 10, 10, 10)]
    with eSurge(target, config, show_progress=False, warmup=False,
                min_token_bucket=32) as llm:
        spec = llm.runner.spec
        assert spec is not None
        spec.policy = AloneOnly(prompts)
        llm.runner.resyncs_heads = resync
        free = llm.stats.num_free_pages
        outs = [o.outputs[0] for o in llm.generate(batch, params)]
        assert spec.unsynced == set() and not spec.sync.head_end and not spec.sync.rewound
        assert llm.stats.num_free_pages == free  # every page back
        return ([o.token_ids for o in outs], [o.num_draft_tokens for o in outs],
                outs[0].num_accepted_tokens, llm.loop.core.num_rewound, free)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prompts", [True, False], ids=["prompt-drafted", "prompt-plain"])
def test_a_request_left_alone_after_plain_steps_drafts_again(
        bigram_dirs: tuple[Path, Path], async_: bool, prompts: bool) -> None:
    target, head = bigram_dirs
    probs = bigram_next_probs(target)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 16, size=n).tolist() for n in (9, 12, 15, 20)]
    expected = [greedy_chain(probs, p, n) for p, n in zip(prompts, (60, 10, 10, 10),
                                                          strict=True)]
    # Without the prompt through the head it computes its prompt again too
    # (writing to the null page: the cache holds it).
    tokens, drafts, accepted, rewound, _ = _run(target, head, async_, True, prompts)
    assert tokens == expected
    # The long request drafted after its prompt, decoded plainly beside the
    # three short ones, then alone was moved back once and drafted again: its
    # head (perfect on the bigram target) has every draft accepted.
    assert rewound == 1
    assert drafts[0] > 8 * BIGRAM_K and accepted == drafts[0]
    # Without moving back it never drafts again after the plain steps.
    tokens, drafts, _, rewound, _ = _run(target, head, async_, False, prompts)
    assert tokens == expected and rewound == 0 and drafts[0] <= 2 * BIGRAM_K
