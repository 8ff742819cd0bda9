"""Decode bursts through eSurge: the same tokens, text and endings as plain steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from esurge import SamplingParams, eSurge
from esurge.errors import InvalidConfigError
from esurge.runner.device_step import decode_burst_step, model_step, sample_step
from esurge.runner.steps.base import WarmupPlan
from esurge.runner.steps.padding import with_tiles
from esurge.runner.warmup import warmup_programs
from tests.engine.conftest import NEW_TOKENS, engine_config, mixed_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPT = "class Reader:\n    def read(self, size"


@pytest.fixture(scope="module")
def burst_engine(tiny_llama_dir: Path) -> Iterator[eSurge]:
    """Async scheduling with bursts of 4 decode iterations."""
    llm = eSurge(tiny_llama_dir, engine_config(async_=True), show_progress=False, decode_steps=4)
    yield llm
    llm.shutdown()


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_bursts_match_transformers(burst_engine: eSurge,
                                   reference_greedy: list[list[int]]) -> None:
    before = burst_engine.scheduler.num_decode_bursts
    outs = burst_engine.generate(mixed_prompts(), GREEDY)
    assert _tokens(outs) == reference_greedy
    assert burst_engine.scheduler.num_decode_bursts > before
    kv = burst_engine.scheduler.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)


def test_a_full_batch_with_a_queue_bursts_and_matches_transformers(
        tiny_llama_dir: Path, reference_greedy: list[list[int]]) -> None:
    # 4 slots for 16 requests: the queue never empties until the end.
    config = engine_config()
    config = dataclasses.replace(config, scheduler_config=dataclasses.replace(
        config.scheduler_config, max_num_seqs=4, max_num_seq_buckets=(4,)))
    with eSurge(tiny_llama_dir, config, show_progress=False, decode_steps=4) as llm:
        outs = llm.generate(mixed_prompts(), GREEDY)
        bursts = llm.scheduler.num_decode_bursts
    assert _tokens(outs) == reference_greedy
    assert bursts >= 16 * (NEW_TOKENS // 4) // 4 // 2  # most decode work ran in bursts


def test_bursts_under_preemption_match_transformers(tiny_llama_dir: Path,
                                                    reference_greedy: list[list[int]]) -> None:
    # 19 usable pages of 8 tokens for 16 requests: preemptions, and bursts only
    # once enough pages are free.
    with eSurge(tiny_llama_dir, engine_config(num_pages=20), show_progress=False,
                decode_steps=4) as llm:
        outs = llm.generate(mixed_prompts(), GREEDY)
        preemptions, bursts = llm.scheduler.num_preemptions, llm.scheduler.num_decode_bursts
        usage = llm.scheduler.kv_cache_manager.usage
    assert _tokens(outs) == reference_greedy
    assert preemptions > 0 and bursts > 0
    assert usage == 0.0


def _mid_burst_stop(engine: eSurge) -> tuple[int, str]:
    """(k, s): the text s of output token k is new at k, and token k sits inside
    a burst of 4 (the prefill step samples token 0, bursts take 1-4, 5-8, ...)."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    deltas = [d.outputs[0].text for d in engine.stream(PROMPT, plain)]
    text = "".join(deltas)
    for k in range(5, 20):
        start = len("".join(deltas[:k]))
        if k % 4 and deltas[k] and text.find(deltas[k]) == start:
            return k, deltas[k]
    raise AssertionError(f"no usable stop string in {deltas!r}")


@pytest.mark.parametrize("case", ["max_tokens", "stop_token", "stop_string", "stop_kept"])
def test_endings_inside_a_burst_match_plain_steps(burst_engine: eSurge, engine: eSurge,
                                                  case: str) -> None:
    full = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True))[0].outputs[0]
    k, stop = _mid_burst_stop(engine)
    params = {
        "max_tokens": SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        "stop_token": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                     stop_token_ids=[full.token_ids[k]]),
        "stop_string": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                      stop=[stop]),
        "stop_kept": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                    stop=[stop], include_stop_str_in_output=True),
    }[case]
    want = engine.generate([PROMPT], params)[0].outputs[0]
    got = burst_engine.generate([PROMPT], params)[0].outputs[0]
    # Each ends strictly inside a burst: 14 tokens end at index 13; a stop at k.
    assert len(want.token_ids) == (14 if case == "max_tokens" else k + 1)
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids, want.text, want.finish_reason, want.stop_reason)


def test_streamed_bursts_add_up_to_the_output(burst_engine: eSurge) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = burst_engine.generate([PROMPT], params)[0].outputs[0]
    deltas = list(burst_engine.stream(PROMPT, params))
    assert deltas[-1].finished
    assert [t for d in deltas for t in d.outputs[0].token_ids] == full.token_ids
    assert "".join(d.outputs[0].text for d in deltas) == full.text
    assert max(len(d.outputs[0].token_ids) for d in deltas) == 4  # a burst's tokens


def test_seeded_sampling_in_bursts_matches_plain_steps(burst_engine: eSurge,
                                                       engine: eSurge) -> None:
    # Draws are keyed by (seed, output position): a burst makes the same ones.
    prompts = mixed_prompts()[:6]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=11 + i,
                             max_tokens=NEW_TOKENS, ignore_eos=True)
              for i, (t, k, p, m) in enumerate([(0.8, None, 1.0, 0.0), (1.2, 20, 1.0, 0.0),
                                                (0.9, None, 0.8, 0.0), (1.0, None, 1.0, 0.1),
                                                (0.0, None, 1.0, 0.0), (0.7, 50, 0.9, 0.05)])]
    before = burst_engine.scheduler.num_decode_bursts
    got = _tokens(burst_engine.generate(prompts, params))
    assert burst_engine.scheduler.num_decode_bursts > before
    assert got == _tokens(engine.generate(prompts, params))


def test_penalised_requests_run_plain_steps_beside_greedy_ones(
        burst_engine: eSurge, reference_greedy: list[list[int]]) -> None:
    prompts = mixed_prompts()[:4]
    params = [GREEDY] * 3 + [SamplingParams(temperature=0.8, seed=3, max_tokens=NEW_TOKENS + 8,
                                            ignore_eos=True, repetition_penalty=1.3)]
    before = burst_engine.scheduler.num_decode_bursts
    outs = burst_engine.generate(prompts, params)
    assert _tokens(outs)[:3] == reference_greedy[:3]
    assert burst_engine.scheduler.num_decode_bursts == before


def test_no_compile_after_warmup(burst_engine: eSurge) -> None:
    def compiled() -> tuple[int, ...]:
        return tuple(f._cache_size() for f in (decode_burst_step, model_step, sample_step))

    before = compiled()
    bursts = burst_engine.scheduler.num_decode_bursts
    for count in (16, 3):
        burst_engine.generate(mixed_prompts()[:count], [
            GREEDY, SamplingParams(temperature=0.9, top_k=8, seed=2, max_tokens=NEW_TOKENS,
                                   ignore_eos=True)] * (count // 2) + [GREEDY] * (count % 2))
        burst_engine.generate(mixed_prompts()[:count], GREEDY)
    assert burst_engine.scheduler.num_decode_bursts > bursts
    assert compiled() == before


@pytest.mark.parametrize("bad", [0, 2.5, True])
def test_decode_steps_is_validated(tiny_llama_dir: Path, bad: object) -> None:
    with pytest.raises(InvalidConfigError) as info:
        eSurge(tiny_llama_dir, engine_config(), show_progress=False, warmup=False,
               decode_steps=bad)  # type: ignore[arg-type]
    assert info.value.field == "decode_steps"


def test_async_logprobs_keep_one_entry_per_token(burst_engine: eSurge) -> None:
    # burst_engine schedules asynchronously; logprobs keep these steps plain.
    # Short requests in the lower rows finish while the long one, above them,
    # still runs: the batch is compacted while its step is in flight.
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs = burst_engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [short, short, long])
    sample = outs[2].outputs[0]
    assert len(sample.token_ids) == 10
    assert len(sample.logprobs) == 10
    assert [entry.token_ids[0] for entry in sample.logprobs] == sample.token_ids
    alone = burst_engine.generate([[10, 11, 12, 13]], long)[0].outputs[0]
    assert [e.token_ids for e in alone.logprobs] == [e.token_ids for e in sample.logprobs]


def test_warm_up_lists_every_kinds_programs_once(burst_engine: eSurge) -> None:
    runner = burst_engine.runner
    assert [kind.name for kind in runner.step_kinds] == ["decode burst", "greedy", "sampled"]
    plan = WarmupPlan(runner.buckets.shapes(), runner.sampler_variants())
    labels = [p.label for p in warmup_programs(runner, plan)]
    assert len(labels) == len(set(labels))
    fresh = WarmupPlan(runner.buckets.shapes(), runner.sampler_variants())
    for kind in runner.step_kinds:  # each kind alone lists what it runs
        alone = WarmupPlan(runner.buckets.shapes(), runner.sampler_variants())
        assert kind.programs(alone), kind.name
    # The model step is shared by the greedy and sampled kinds: listed once.
    shared = [p.label for k in runner.step_kinds for p in k.programs(fresh)]
    assert sum(label.startswith("model step") for label in shared) == len(
        with_tiles(runner.buckets.shapes(), runner.tiled_attention))
