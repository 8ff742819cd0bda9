"""Greedy generation through eSurge is token-identical to transformers' generate,
whatever the scheduling options."""

from __future__ import annotations

from pathlib import Path

import pytest

from esurge import SamplingParams, eSurge
from tests.engine.conftest import NEW_TOKENS, engine_config, mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_default_engine_matches_transformers(engine: eSurge,
                                             reference_greedy: list[list[int]]) -> None:
    outs = engine.generate(mixed_prompts(), GREEDY)
    assert tokens(outs) == reference_greedy
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)


def test_prefix_hits_keep_tokens(engine: eSurge, reference_greedy: list[list[int]]) -> None:
    engine.generate(mixed_prompts(), GREEDY)
    again = engine.generate(mixed_prompts(), GREEDY)
    assert tokens(again) == reference_greedy
    # Every prompt of 9+ tokens has a whole cached page (page_size 8); the
    # last prompt token is always recomputed.
    for prompt, out in zip(mixed_prompts(), again, strict=True):
        assert out.num_cached_tokens == ((len(prompt) - 1) // 8) * 8


@pytest.mark.parametrize(
    "options",
    [
        {"chunked": False},
        {"prefix": False},
        {"async_": True},
        {"num_pages": 20},  # 19 usable pages of 8 tokens: forces preemption
    ],
    ids=["no-chunked-prefill", "no-prefix-cache", "async-scheduling", "preemption"],
)
def test_options_keep_tokens(tiny_llama_dir: Path, reference_greedy: list[list[int]],
                             options: dict[str, object]) -> None:
    with eSurge(tiny_llama_dir, engine_config(**options), show_progress=False) as llm:  # type: ignore[arg-type]
        outs = llm.generate(mixed_prompts(), GREEDY)
        preemptions = llm.scheduler.num_preemptions if options.get("num_pages") else None
        usage = llm.scheduler.kv_cache_manager.usage
    assert tokens(outs) == reference_greedy
    if preemptions is not None:
        assert preemptions > 0
    assert usage == 0.0
