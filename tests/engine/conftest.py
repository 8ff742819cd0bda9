"""Engines over the tiny Llama, shared per session so XLA compiles once per shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from esurge.config import CacheConfig, Config, SchedulerConfig

MAX_MODEL_LEN = 96
NEW_TOKENS = 32


def engine_config(*, chunked: bool = True, prefix: bool = True, async_: bool = False,
                  num_pages: int = 256, threshold: int = 16) -> Config:
    """The test engines' config; only the options under test vary."""
    return Config(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=MAX_MODEL_LEN,
                        max_model_len=MAX_MODEL_LEN, chunked_prefill_enabled=chunked,
                        long_prefill_token_threshold=threshold if chunked else 0,
                        max_num_seq_buckets=(16,), async_scheduling=async_),
        CacheConfig(num_pages=num_pages, page_size=8, enable_prefix_caching=prefix),
    )


def mixed_prompts(n: int = 16, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    """n prompts of 3..60 tokens (ids from 3, so no special tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(3, 60, n).astype(int)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lengths]


@pytest.fixture(scope="session")
def reference_greedy(tiny_llama_dir: Path) -> list[list[int]]:
    """transformers' greedy continuation of mixed_prompts(), NEW_TOKENS each."""
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()
    # Like ignore_eos: EOS may be generated and does not end the sequence
    # (min_new_tokens would instead mask it).
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for prompt in mixed_prompts():
            ids = torch.tensor([prompt])
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="session")
def engine(tiny_llama_dir: Path) -> Iterator[object]:
    """The default test engine: chunked prefill, prefix caching, sync scheduling."""
    from esurge import eSurge

    llm = eSurge(tiny_llama_dir, engine_config(), show_progress=False)
    yield llm
    llm.shutdown()
