"""A float32 model over a bfloat16 KV cache (EngineSettings.kv_cache_dtype, --kv-cache-dtype).

The cache stores each key and value rounded to bfloat16 once; attention reads
them widened and stays float32. On the tiny Llama that changes no greedy token
of the test prompts against transformers in float32 (its top logits are far
apart compared with the rounding), and the same memory holds twice the pages.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest

from esurge import SamplingParams, eSurge
from esurge.config import CacheConfig, Config
from tests.engine.conftest import NEW_TOKENS, engine_config, mixed_prompts


@pytest.fixture(scope="module")
def bf16_cache_engine(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    llm = eSurge(tiny_llama_dir, engine_config(), show_progress=False, kv_cache_dtype="bfloat16")
    yield llm
    llm.shutdown()


def test_the_cache_is_bfloat16_under_a_float32_model(bf16_cache_engine: eSurge) -> None:
    runner = bf16_cache_engine.runner
    assert bf16_cache_engine.model.dtype == "float32"
    assert {a.dtype for a in (*runner.kv_cache.keys, *runner.kv_cache.values)} == {
        jnp.dtype(jnp.bfloat16)}


def test_greedy_tokens_match_transformers_in_float32(
        bf16_cache_engine: eSurge, reference_greedy: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = bf16_cache_engine.generate(mixed_prompts(), params)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference_greedy


def test_the_same_memory_holds_twice_the_pages(tiny_llama_dir: Path) -> None:
    from esurge.models import load_model

    model = load_model(tiny_llama_dir)
    full = model.cache_groups(64, 8).bytes_per_page
    half = model.cache_groups(64, 8, "bfloat16").bytes_per_page
    assert full == 2 * half


def test_an_unknown_cache_dtype_is_refused_naming_the_field(tiny_llama_dir: Path) -> None:
    from esurge.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError) as info:
        eSurge(tiny_llama_dir, Config(engine_config().scheduler_config,
                                      CacheConfig(num_pages=64, page_size=8,
                                                  enable_prefix_caching=True)),
               show_progress=False, kv_cache_dtype="int8")
    assert info.value.field == "kv_cache_dtype"
