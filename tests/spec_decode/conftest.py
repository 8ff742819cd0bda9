"""Shared fixtures: the bigram target with a perfect Eagle head, and its warmed engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.spec_decode.helpers import bigram_pair, spec_config

torch.set_num_threads(1)

BIGRAM_K = 3


@pytest.fixture(scope="session")
def bigram_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target dir, perfect EAGLE-1 head dir) of the bigram Llama."""
    return bigram_pair(tmp_path_factory.mktemp("bigram"))


@pytest.fixture(scope="session")
def bigram_engine(bigram_dirs: tuple[Path, Path]) -> Iterator[object]:
    """The bigram target with its head, k=3, fully warmed up (shared: compiles once)."""
    from esurge import eSurge

    target, head = bigram_dirs
    config = spec_config(BIGRAM_K, head, max_num_seqs=32, batched_tokens=64)
    llm = eSurge(target, config, show_progress=False, min_token_bucket=32,
                 speculation="always")  # every step drafts: the counts below are exact
    yield llm
    llm.shutdown()
