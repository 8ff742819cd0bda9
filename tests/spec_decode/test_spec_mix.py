"""The mix fuzz of tests/engine/test_mix_fuzz.py with Eagle drafting every
step: each greedy request of a mix, run at once on a tight speculative engine
(k = 3, a head that is right about half the time, async and priority
scheduling, 23 usable pages: requests preempt, resume and share cached pages
while drafts are accepted and rejected, and steps of greedy decoding hand
their drafts to the next step), gets what the plain engine gives it
alone, with every option that edits the logits (penalties, bias,
allow-lists, bad words, min_tokens) applied at each verified position as if
the tokens before it had been emitted one by one."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
from hypothesis import given, seed

from esurge import eSurge
from tests.engine.test_mix_fuzz import (
    CUT_SHORT,
    Mix,
    _check_mix,
    fuzz_settings,
    greedy,
    mixes,
)
from tests.spec_decode.helpers import bigram_pair, spec_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = int(os.environ.get("ESURGE_FUZZ_EXAMPLES", "30"))
VOCAB = 16  # the bigram target's
K = 3


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[eSurge, eSurge]]:
    """(plain and roomy, synchronous; speculative and tight)."""
    target, head = bigram_pair(tmp_path_factory.mktemp("spec_mix"), perturb=0.3)
    tight = spec_config(K, head, num_pages=24, async_=True)
    tight = dataclasses.replace(tight, scheduler_config=dataclasses.replace(
        tight.scheduler_config, policy="priority", long_prefill_token_threshold=8))
    with (eSurge(target, spec_config(None, None), warmup=False, show_progress=False) as plain,
          eSurge(target, tight, warmup=False, show_progress=False,
                 speculation="always") as spec):
        yield plain, spec


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@fuzz_settings(EXAMPLES)
@given(mix=mixes(vocab=VOCAB, text=False))
def test_a_greedy_mix_with_drafts_gives_what_plain_decoding_gives_alone(
        engines: tuple[eSurge, eSurge], mix: Mix) -> None:
    # Greedy only: a sampled request draws its tokens through rejection
    # sampling, the same distribution but not the same draws.
    _check_mix(*engines, greedy(mix))


def test_the_mixes_drafted_preempted_and_shared_pages(engines: tuple[eSurge, eSurge]) -> None:
    """The fuzz above ran under the pressure it claims (run after it in file order):
    drafts both accepted and rejected, preemptions, prefix hits, streams cut short."""
    stats = engines[1].stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    # Steps of greedy decoding requests handed their drafts to the next step,
    # dispatched before they were read (moved back on the device).
    assert engines[1].loop.core.num_drafts_ahead > 0
    assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens, stats.spec
    assert CUT_SHORT[engines[1]] > 0
