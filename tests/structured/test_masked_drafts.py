"""A constrained request's drafts are drawn under its grammar's masks.

The trained tiny-stdlib model and its Eagle head, speculation always on, k = 3.
A choice of one sentence forces every token: drafts drawn under the masks
are those tokens, so each verification drafts up to k and accepts them all.
Unmasked drafts of this Python model would be refused by the grammar and
cut on the host, leaving few or none to verify.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esurge import SamplingParams, SpeculativeConfig, StructuredOutputsParams
from esurge.config import CacheConfig, Config, SchedulerConfig
from esurge.spec_decode.proposer import masked_draft_step

REPO = Path(__file__).resolve().parents[2]
MODEL, HEAD = REPO / "models" / "tiny-stdlib", REPO / "models" / "tiny-stdlib-eagle"
SENTENCE = "the quick brown fox jumps over the lazy dog while the cat sleeps"


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from esurge import eSurge

    config = Config(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                        chunked_prefill_enabled=True, max_num_seq_buckets=(8,)),
        CacheConfig(num_pages=200, page_size=8, enable_prefix_caching=False),
        SpeculativeConfig(3, str(HEAD)))
    llm = eSurge(MODEL, config, show_progress=False, min_token_bucket=64,
                 speculation="always")
    yield llm
    llm.shutdown()


def test_forced_tokens_are_drafted_and_accepted(engine: Any) -> None:
    forced = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(choice=(SENTENCE,)))
    before, compiled = engine.stats.spec, masked_draft_step._cache_size()
    out = engine.generate(["import os\n"], forced)[0].outputs[0]
    after = engine.stats.spec
    assert masked_draft_step._cache_size() == compiled  # warm-up compiled the masked step
    assert out.text == SENTENCE and str(out.finish_reason) == "stop"
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    tokens = len(out.token_ids)
    # Every draft is the forced token, so all are accepted, and they carry most of the output.
    assert accepted == drafted, (accepted, drafted)
    assert accepted >= tokens // 2, (accepted, tokens)


def test_unconstrained_rows_beside_a_constrained_one_keep_their_drafts(engine: Any) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = engine.generate(["def parse(self, text):\n    "], plain)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(choice=(SENTENCE,)))
    outs = engine.generate(["def parse(self, text):\n    ", "import os\n"], [plain, forced])
    assert list(outs[0].outputs[0].token_ids) == list(alone)
    assert outs[1].outputs[0].text == SENTENCE


def test_sampled_drafts_under_masks_keep_outputs_valid(engine: Any) -> None:
    from tests.structured.cases import JSON_SCHEMAS, validates_json

    schema = JSON_SCHEMAS["person"]
    params = SamplingParams(temperature=1.0, max_tokens=100, n=6, structured_outputs=(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    before, compiled = engine.stats.spec, masked_draft_step._cache_size()
    outs = engine.generate(["    return {"], params)[0].outputs
    assert masked_draft_step._cache_size() == compiled  # the sampled variant too
    assert engine.stats.spec.num_accepted_tokens > before.num_accepted_tokens
    stopped = [o.text for o in outs if str(o.finish_reason) == "stop"]
    assert stopped, [str(o.finish_reason) for o in outs]
    assert all(validates_json(schema, text) for text in stopped), stopped


def test_a_constrained_request_the_gate_stops_takes_no_more_masked_drafts(engine: Any) -> None:
    from esurge.spec_decode.policy import AdaptiveSpeculation
    from esurge.spec_decode.request_gate import RequestGate
    from tests.spec_decode.test_draft_length import _costs

    spec = engine.runner.spec
    saved = spec.policy, spec.gate, spec.lengths
    try:
        # Trials everywhere (cheap drafting costs), and a gate that stops every
        # request after its first verification.
        spec.policy = AdaptiveSpeculation(settle=0)
        spec.gate = RequestGate(min_verifications=1, margin=1e6)
        spec.calibrate(_costs(1.0, 0.01, 0.01, k=3))
        forced = SamplingParams(temperature=0.0, max_tokens=60,
                                structured_outputs=StructuredOutputsParams(choice=(SENTENCE,)))
        before = engine.stats.spec
        out = engine.generate(["import os\n"], forced)[0].outputs[0]
        after = engine.stats.spec
    finally:
        spec.policy, spec.gate, spec.lengths = saved
    assert out.text == SENTENCE and str(out.finish_reason) == "stop"
    # One verification of at most 3 masked drafts, then plain decoding: the
    # masked proposer's drafts for the stopped request are dropped.
    assert 0 < after.num_draft_tokens - before.num_draft_tokens <= 3
