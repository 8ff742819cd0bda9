"""Engines for the structured-output tests, shared per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from esurge.config import CacheConfig, Config, SchedulerConfig

MAX_MODEL_LEN = 256


def so_config(*, async_: bool = True, chunked: bool = True, num_pages: int = 400,
              max_num_seqs: int = 32) -> Config:
    """A config with room for JSON outputs; only the options under test vary."""
    return Config(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128,
                        max_model_len=MAX_MODEL_LEN, chunked_prefill_enabled=chunked,
                        long_prefill_token_threshold=32 if chunked else 0,
                        max_num_seq_buckets=(max_num_seqs,), async_scheduling=async_),
        CacheConfig(num_pages=num_pages, page_size=8, enable_prefix_caching=True),
    )


@pytest.fixture(scope="session")
def random_engine(tiny_llama_dir: Path) -> Iterator[object]:
    """The random tiny Llama (vocab 512), async scheduling, 32 rows."""
    from esurge import eSurge

    llm = eSurge(tiny_llama_dir, so_config(), show_progress=False, min_token_bucket=32)
    yield llm
    llm.shutdown()
