"""Model fixtures: one tiny checkpoint per family, loaded both by transformers and by us."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from esurge.models import LoadedModel, cpu_kernels, load_model
from tests.models.checkpoints import build_model, hf_config, save_checkpoint

torch.set_num_threads(1)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


@dataclass
class Pair:
    """A checkpoint on disk, the transformers model that wrote it, and our load of it."""

    path: Path
    hf: Any
    loaded: LoadedModel


@pytest.fixture(scope="session")
def make_pair(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Pair]:
    """Build (once per session and arguments) a checkpoint of a family with overrides."""
    cache: dict[tuple[str, int, tuple[tuple[str, str], ...]], Pair] = {}

    def make(family: str, seed: int = 0, **overrides: Any) -> Pair:
        key = (family, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            model = build_model(hf_config(family, **overrides), seed)
            path = save_checkpoint(model, tmp_path_factory.mktemp(family))
            cache[key] = Pair(path, model, load_model(path))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def cpu_kernels_built() -> None:
    """Fails (not skips) where the CPU kernels did not build: a machine without
    a compiler must still run everything else, but where the kernels are the
    subject their absence is a failure."""
    assert cpu_kernels.kernel_available(), "the CPU kernels failed to build (see the log)"
