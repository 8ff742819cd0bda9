"""Runtime guarantees: no compile after warm-up, a memory-sized cache, clean shutdown."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig

from esurge import SamplingParams, eSurge
from esurge.runner.device_step import model_step, prompt_logprobs_step, sample_step
from esurge.runner.steps.base import WarmupPlan
from esurge.runner.warmup import warmup_programs
from tests.engine.conftest import engine_config, mixed_prompts


def _compiled() -> tuple[int, ...]:
    return tuple(f._cache_size() for f in (model_step, sample_step, prompt_logprobs_step))


def test_no_compile_after_warmup(engine: eSurge) -> None:
    before = _compiled()
    engine.generate(mixed_prompts(), [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12),
        SamplingParams(temperature=0, logprobs=2, max_tokens=12),
        SamplingParams(temperature=1.0, frequency_penalty=0.5, logit_bias={5: 1.0},
                       max_tokens=12, prompt_logprobs=1),
    ] * 4)
    assert _compiled() == before


def test_cache_sized_from_memory_budget(tiny_llama_dir: Path) -> None:
    config = engine_config()
    config = dataclasses.replace(
        config, cache_config=dataclasses.replace(config.cache_config, num_pages=None))
    with eSurge(tiny_llama_dir, config, show_progress=False, warmup=False) as llm:
        pages = llm.runner.num_pages
        out = llm.generate([mixed_prompts()[0]], SamplingParams(temperature=0, max_tokens=4))
    # 16 requests x 12 pages of 8 tokens (96-token limit) + the null page is all
    # that could ever be used; this model's pages are tiny, so the budget covers it.
    assert pages == 16 * 12 + 1
    assert len(out[0].outputs[0].token_ids) == 4


def test_shutdown_fails_pending_requests(tiny_llama_dir: Path) -> None:
    llm = eSurge(tiny_llama_dir, engine_config(), show_progress=False)
    llm.shutdown()
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    except RuntimeError as err:
        assert "not running" in str(err)
    else:
        raise AssertionError("generate after shutdown must fail")


def test_no_config_derives_one_from_the_checkpoint(tiny_llama_dir: Path,
                                                   engine: eSurge) -> None:
    with eSurge(tiny_llama_dir, show_progress=False, warmup=False) as llm:
        sched, cache = llm.config.scheduler_config, llm.config.cache_config
        prompts = mixed_prompts()[:3]
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    max_len = AutoConfig.from_pretrained(tiny_llama_dir).max_position_embeddings
    # On CPU (these tests' backend): 16 requests, 256-token steps, as `make serve`.
    assert (sched.max_model_len, sched.max_num_batched_tokens) == (max_len, min(256, max_len))
    assert sched.max_num_seqs == 16
    assert sched.async_scheduling and sched.chunked_prefill_enabled
    assert cache.num_pages is None and cache.enable_prefix_caching
    # Async scheduling changes nothing a user sees: the same greedy tokens as
    # the shared (synchronous) engine.
    want = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in want]


def test_final_only_callbacks_get_just_the_finished_output(engine: eSurge) -> None:
    got: dict[str, list] = {"every": [], "final": []}
    done = threading.Semaphore(0)

    def collect(kind: str) -> Callable[[object], None]:
        def on_output(item: object) -> None:
            got[kind].append(item)
            if getattr(item, "finished", True):
                done.release()
        return on_output

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.submit([5, 6, 7], params, collect("every"))
    engine.submit([5, 6, 7], params, collect("final"), final_only=True)
    assert done.acquire(timeout=60) and done.acquire(timeout=60)
    assert len(got["every"]) > 1 and not any(o.finished for o in got["every"][:-1])
    assert [o.finished for o in got["final"]] == [True]
    streamed = [t for delta in got["every"] for t in delta.outputs[0].token_ids]
    assert got["final"][0].outputs[0].token_ids == streamed


def test_request_buckets_below_the_floor_compile_nothing_more_and_change_no_token(
        tiny_llama_dir: Path, reference_greedy: list[list[int]]) -> None:
    """Buckets 4 and 16 (make serve's): a lone request's step pads its model
    requests to 16, its plain sampler to the model's rows, its penalty sampler
    only to 4; every kind of request, alone and mixed, runs on what warm-up
    compiled, and greedy tokens are transformers'."""
    from esurge.runner.device_step import sampled_logprobs_step

    config = engine_config()
    config = dataclasses.replace(config, scheduler_config=dataclasses.replace(
        config.scheduler_config, max_num_seq_buckets=(4, 16)))
    jitted = (model_step, sample_step, sampled_logprobs_step, prompt_logprobs_step)
    with eSurge(tiny_llama_dir, config, show_progress=False) as llm:
        runner = llm.runner
        plan_labels = [p.label for p in warmup_programs(runner, WarmupPlan(
            runner.buckets.shapes(), runner.sampler_variants()))]
        assert sum(label.startswith("model step") for label in plan_labels) == len(
            runner.buckets.token_buckets)
        plain = [label for label in plan_labels
                 if label.startswith("sampler") and "dense=False" in label]
        assert plain and all(label.startswith("sampler requests=16 ") for label in plain)
        before = [f._cache_size() for f in jitted]
        prompts = mixed_prompts()
        greedy = SamplingParams(temperature=0, max_tokens=12)
        kinds = [greedy, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12),
                 SamplingParams(temperature=0, logprobs=2, max_tokens=12),
                 SamplingParams(temperature=1.0, frequency_penalty=0.5, logit_bias={5: 1.0},
                                max_tokens=12, prompt_logprobs=1)]
        for params in kinds:
            llm.generate([prompts[0]], params)
        alone = llm.generate([prompts[3]], greedy)[0].outputs[0].token_ids
        mixed = llm.generate(prompts, kinds * 4)
        assert [f._cache_size() for f in jitted] == before
    assert alone == reference_greedy[3][:12]
    assert mixed[0].outputs[0].token_ids == reference_greedy[0][:12]
