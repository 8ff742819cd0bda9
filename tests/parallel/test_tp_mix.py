"""The mix fuzz of tests/engine/test_mix_fuzz.py on an 8-way tensor-parallel
engine: each greedy request of a mix, run at once on a tight engine split over
eight devices (250 vocabulary rows padded to 256, async and priority
scheduling, decode bursts of 4, preempting), gets what one device gives it
alone; every option that edits the logits (penalties, bias, allow-lists, bad
words, min_tokens) acts on the vocabulary-sharded logits as on whole ones."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, seed

from esurge import EngineSettings, ParallelConfig, eSurge
from tests.engine.conftest import engine_config
from tests.engine.test_mix_fuzz import (
    CUT_SHORT,
    Mix,
    _check_mix,
    fuzz_settings,
    greedy,
    mixes,
    tight_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = int(os.environ.get("ESURGE_FUZZ_EXAMPLES", "20"))
SHAPE = {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 250}


@pytest.fixture(scope="module")
def engines(checkpoint: Callable[..., Path]) -> Iterator[tuple[eSurge, eSurge]]:
    """(one device, roomy and synchronous; eight devices, tight)."""
    path = checkpoint("llama", **SHAPE)
    with (eSurge(path, engine_config(), warmup=False, show_progress=False) as one,
          eSurge(path, tight_config(), warmup=False, show_progress=False,
                 parallel_config=ParallelConfig(8),
                 settings=EngineSettings(decode_steps=4)) as eight):
        assert eight.runner.mesh is not None and eight.runner.mesh.size == 8
        yield one, eight


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@fuzz_settings(EXAMPLES)
@given(mix=mixes(vocab=SHAPE["vocab_size"], text=False))
def test_a_greedy_mix_over_eight_devices_gives_what_one_device_gives_alone(
        engines: tuple[eSurge, eSurge], mix: Mix) -> None:
    # Greedy only: sampling draws against sums taken in another order, and a
    # draw near a top-p or min-p edge may land on the other side of it.
    _check_mix(*engines, greedy(mix))


def test_the_mixes_preempted_and_shared_pages(engines: tuple[eSurge, eSurge]) -> None:
    """The fuzz above ran under the pressure it claims (run after it in file order)."""
    stats = engines[1].stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert CUT_SHORT[engines[1]] > 0
