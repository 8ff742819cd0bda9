"""Checkpoints and the one workload every tensor-parallel degree runs.

This directory is collected only in a process started with 8 simulated CPU
devices (tests/conftest.py; `make test` starts it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

from esurge import SamplingParams, eSurge
from esurge.config import CacheConfig, Config, SchedulerConfig
from esurge.outputs import TokenLogprobs
from tests.engine.conftest import mixed_prompts
from tests.models.checkpoints import build_model, hf_config, save_checkpoint

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=NEW_TOKENS,
                        ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                          ignore_eos=True)


@pytest.fixture(scope="session", autouse=True)
def eight_devices() -> None:
    """Fail loudly if this process was started without the simulated devices."""
    assert jax.device_count() == 8, jax.devices()


def engine_config(num_pages: int = 28) -> Config:
    """Chunked prefill (16-token chunks), prefix caching, and few enough pages
    that the workload's eight requests preempt each other."""
    return Config(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
                        chunked_prefill_enabled=True, long_prefill_token_threshold=16,
                        max_num_seq_buckets=(8,)),
        CacheConfig(num_pages=num_pages, page_size=8, enable_prefix_caching=True),
    )


@dataclass
class Run:
    """What one engine produced for the workload."""

    greedy: list[list[int]]
    again: list[list[int]]
    cached: list[int]
    seeded: list[list[int]]
    logprobs: list[TokenLogprobs]
    prompt_logprobs: list[TokenLogprobs]
    preemptions: int
    usage: float


def run_workload(llm: eSurge) -> Run:
    """Greedy (chunked, preempting), the same prompts again (prefix hits),
    seeded sampling, and logprobs."""
    prompts = mixed_prompts(8, vocab=250)
    greedy = llm.generate(prompts, GREEDY)
    preemptions = llm.scheduler.num_preemptions
    again = llm.generate(prompts[4:], GREEDY)
    seeded = llm.generate(prompts[:4], SEEDED)
    scored = llm.generate(prompts[6:7], LOGPROBS)[0]
    return Run(
        greedy=[o.outputs[0].token_ids for o in greedy],
        again=[o.outputs[0].token_ids for o in again],
        cached=[o.num_cached_tokens for o in again],
        seeded=[o.outputs[0].token_ids for o in seeded],
        logprobs=list(scored.outputs[0].logprobs or []),
        prompt_logprobs=[p for p in scored.prompt_logprobs or [] if p is not None],
        preemptions=preemptions,
        usage=llm.scheduler.kv_cache_manager.usage,
    )


def assert_same_run(got: Run, want: Run) -> None:
    """Identical tokens, cache hits and preemptions; logprobs within 1e-5."""
    assert got.greedy == want.greedy
    assert got.again == want.again
    assert got.cached == want.cached
    assert got.seeded == want.seeded
    for mine, theirs in [*zip(got.logprobs, want.logprobs, strict=True),
                         *zip(got.prompt_logprobs, want.prompt_logprobs, strict=True)]:
        assert mine.token_ids == theirs.token_ids
        np.testing.assert_allclose(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=0)
    # The same schedule: tensor parallelism changes nothing the scheduler sees.
    assert got.preemptions == want.preemptions
    assert got.usage == 0.0


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint(family, **overrides): a tiny random checkpoint, built once."""
    built: dict[tuple[str, tuple[tuple[str, object], ...]], Path] = {}

    def get(family: str, **overrides: object) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"tp_{family}")
            built[key] = save_checkpoint(build_model(hf_config(family, **overrides), 0), path)
        return built[key]

    return get


@pytest.fixture(scope="session")
def reference(checkpoint: Callable[..., Path]) -> Callable[..., Run]:
    """reference(family, **overrides): the workload on one device, run once."""
    runs: dict[tuple[str, tuple[tuple[str, object], ...]], Run] = {}

    def get(family: str, **overrides: object) -> Run:
        key = (family, tuple(sorted(overrides.items())))
        if key not in runs:
            with eSurge(checkpoint(family, **overrides), engine_config(), warmup=False,
                        show_progress=False) as llm:
                runs[key] = run_workload(llm)
        return runs[key]

    return get
