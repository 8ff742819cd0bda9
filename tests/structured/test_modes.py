"""Constrained outputs are the same in every engine mode.

The trained tiny-stdlib model (so drafts from its Eagle head are often
right), a batch mixing every constraint kind with unconstrained requests:
seeded sampling gives identical outputs with async scheduling on and off,
decode bursts on and off, chunked prefill on and off and under a page
budget that forces preemption; greedy outputs are identical with
speculative decoding on and off.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esurge import SamplingParams, SpeculativeConfig, StructuredOutputsParams
from esurge.config import CacheConfig, Config, SchedulerConfig
from tests.structured.cases import JSON_SCHEMAS, validates_json

REPO = Path(__file__).resolve().parents[2]
MODEL, HEAD = REPO / "models" / "tiny-stdlib", REPO / "models" / "tiny-stdlib-eagle"
PROMPTS = ["def parse(self, text):\n    ", "import os\n", "class Point:\n    ",
           "    return {", "# settings\nconfig = ", "x = [", "if value is None:\n",
           "assert "]
CONSTRAINTS: list[StructuredOutputsParams | None] = [
    StructuredOutputsParams(json=JSON_SCHEMAS["person"], disable_any_whitespace=True),
    StructuredOutputsParams(regex=r"[a-z_]{2,8}\([a-z]{1,4}(, [a-z]{1,4}){0,2}\)"),
    None,
    StructuredOutputsParams(choice=("True", "False", "None")),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    StructuredOutputsParams(grammar='start: NAME " = " NUMBER\nNAME: /[a-z]{1,6}/\n'
                                    'NUMBER: /[0-9]{1,4}/'),
    None,
    StructuredOutputsParams(json=JSON_SCHEMAS[sorted(JSON_SCHEMAS)[3]],
                            disable_any_whitespace=True),
]


def _config(*, async_: bool = False, chunked: bool = True, num_pages: int = 300,
            spec: bool = False) -> Config:
    return Config(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64 if chunked else 128,
                        max_model_len=128,
                        chunked_prefill_enabled=chunked,
                        long_prefill_token_threshold=16 if chunked else 0,
                        max_num_seq_buckets=(8,), async_scheduling=async_),
        CacheConfig(num_pages=num_pages, page_size=8, enable_prefix_caching=True),
        SpeculativeConfig(3, str(HEAD)) if spec else None,
    )


def _params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=i, max_tokens=80, structured_outputs=so)
            for i, so in enumerate(CONSTRAINTS)]


def _outputs(engine: Any, temperature: float) -> list[tuple[list[int], str]]:
    outs = engine.generate(PROMPTS, _params(temperature))
    return [(list(o.outputs[0].token_ids), str(o.outputs[0].finish_reason)) for o in outs]


@pytest.fixture(scope="module")
def baseline() -> Iterator[dict[str, list[tuple[list[int], str]]]]:
    """Outputs of the plain engine: sync, chunked prefill, room for everything."""
    from esurge import eSurge

    llm = eSurge(MODEL, _config(), show_progress=False, min_token_bucket=64)
    try:
        yield {"sampled": _outputs(llm, 1.0), "greedy": _outputs(llm, 0.0),
               "texts": [o.outputs[0].text for o in llm.generate(PROMPTS, _params(1.0))]}
    finally:
        llm.shutdown()


def test_baseline_outputs_keep_their_constraints(
        baseline: dict[str, list[Any]]) -> None:
    texts = baseline["texts"]
    reasons = [r for _, r in baseline["sampled"]]
    assert validates_json(JSON_SCHEMAS["person"], texts[0]) or reasons[0] == "length"
    assert texts[3] in ("True", "False", "None")
    assert texts[5].split(" = ")[0].isalpha() or reasons[5] == "length"
    assert reasons.count("stop") >= 4, reasons


@pytest.mark.parametrize("mode", ["async", "bursts", "no_chunking", "preemption"])
def test_same_sampled_outputs_in_every_mode(baseline: dict[str, list[Any]], mode: str) -> None:
    from esurge import eSurge

    config = {"async": _config(async_=True), "bursts": _config(async_=True),
              "no_chunking": _config(chunked=False),
              "preemption": _config(num_pages=24)}[mode]
    steps = 4 if mode == "bursts" else 1
    llm = eSurge(MODEL, config, show_progress=False, min_token_bucket=64, decode_steps=steps)
    try:
        assert _outputs(llm, 1.0) == baseline["sampled"]
        if mode == "preemption":
            assert llm.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


def test_same_greedy_outputs_with_speculative_decoding(baseline: dict[str, list[Any]]) -> None:
    from esurge import eSurge

    llm = eSurge(MODEL, _config(spec=True), show_progress=False, min_token_bucket=64,
                speculation="always")
    try:
        assert _outputs(llm, 0.0) == baseline["greedy"]
        stats = llm.stats.spec
        assert stats.num_accepted_tokens > 0  # drafts were verified, some accepted
    finally:
        llm.shutdown()
