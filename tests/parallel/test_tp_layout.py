"""What tensor parallelism compiles to: collectives, per-device bytes, donation."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from esurge import ParallelConfig, SamplingParams, eSurge
from esurge.models.cpu_kernels import kernel_available
from esurge.models.tensor_parallel import param_spec
from esurge.runner.device_step import model_step, prompt_logprobs_step, sample_step
from esurge.runner.packed_inputs import pack_inputs
from esurge.runner.steps.padding import padding_batch
from tests.engine.conftest import mixed_prompts
from tests.parallel.conftest import GREEDY, engine_config

_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* (all-reduce|all-gather|all-to-all|"
                         r"reduce-scatter|collective-permute)\(")


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def engine(request: pytest.FixtureRequest, checkpoint: Callable[..., Path]) -> Iterator[eSurge]:
    with eSurge(checkpoint("llama"), engine_config(), warmup=False, show_progress=False,
                parallel_config=ParallelConfig(request.param)) as llm:
        yield llm


def _model_step_hlo(llm: eSurge, tokens: int = 16, requests: int = 8) -> str:
    runner = llm.runner
    flat, layout = pack_inputs(padding_batch(runner, tokens, requests),
                               np.full(tokens, -1, np.int32))
    with runner.on_mesh():
        return str(model_step.lower(runner.model.model_state, runner.kv_cache, flat,
                                    runner.device.prev_tokens, layout).compile().as_text())


def _collectives(llm: eSurge) -> list[tuple[str, tuple[int, ...]]]:
    return [(op, tuple(int(d) for d in dims.split(",") if d))
            for _, dims, op in _COLLECTIVE.findall(_model_step_hlo(llm))]


@pytest.mark.slow
def test_the_cpu_kernels_run_on_each_shard(engine: eSurge) -> None:
    text = _model_step_hlo(engine)
    layers = engine.model.config.num_layers
    built = kernel_available()
    # Per layer: attention, and the qkv, o, gate/up and down matmuls; then the LM head.
    assert text.count('custom_call_target="esurge_paged_attention"') == layers * built
    assert text.count('custom_call_target="esurge_packed_matmul"') == (4 * layers + 1) * built


@pytest.mark.slow
def test_one_all_reduce_per_row_parallel_matmul_and_no_weight_gathered(engine: eSurge) -> None:
    ops = _collectives(engine)
    layers = engine.model.config.num_layers
    # The design: the embedding's vocab-parallel lookup, then o_proj and
    # down_proj of each layer, each one all-reduce of the [tokens, hidden] sums.
    sums = (16, engine.model.config.hidden_size)
    reduces = [shape for op, shape in ops if op == "all-reduce"]
    assert [s for s in reduces if s == sums] == [sums] * (1 + 2 * layers)
    # Greedy over vocab-parallel logits (`first_argmax`): each row's maximum,
    # then the first position holding it, one value per row each.
    picks = [s for s in reduces if s != sums]
    assert len(picks) == 2 and picks[0] == picks[1] and len(picks[0]) == 1
    assert picks[0][0] <= engine.runner.max_rows
    weights = {tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(engine.model.params)}
    gathers = [shape for op, shape in ops if op == "all-gather"]
    # Nothing gathers a weight nor a logits row.
    assert all(shape not in weights for shape in gathers)
    assert all(math.prod(shape) < engine.model.vocab_size for shape in gathers)
    assert {op for op, _ in ops} <= {"all-reduce", "all-gather"}


def _device_bytes(tree: object, device: jax.Device) -> int:
    return sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
               for shard in leaf.addressable_shards if shard.device == device)


@pytest.mark.slow
def test_each_device_holds_its_share(engine: eSurge) -> None:
    tp = engine.runner.mesh.size
    leaves = jax.tree_util.tree_leaves_with_path(engine.model.params)
    whole = sum(leaf.nbytes for _, leaf in leaves)
    # Norm weights are the documented replication.
    names = [tuple(str(getattr(k, "key", k)) for k in path) for path, _ in leaves]
    copied = sum(leaf.nbytes for name, (_, leaf) in zip(names, leaves, strict=True)
                 if all(axis is None for axis in param_spec(name, leaf.ndim)))
    assert copied == engine.model.config.hidden_size * 4 * (1 + 2 * engine.model.config.num_layers)
    cache = engine.runner.kv_cache
    cache_bytes = sum(a.nbytes for a in (*cache.keys, *cache.values))
    for device in engine.runner.mesh.devices.flat:
        assert _device_bytes(engine.model.params, device) == (whole - copied) // tp + copied
        assert _device_bytes((cache.keys, cache.values), device) == cache_bytes // tp


@pytest.mark.slow
def test_the_cache_is_donated_into_every_step(engine: eSurge) -> None:
    before = engine.runner.kv_cache.keys[0]
    sharding = before.sharding
    engine.generate([[3, 4, 5, 6, 7]], GREEDY)
    after = engine.runner.kv_cache.keys[0]
    assert before.is_deleted()
    assert after.sharding == sharding
    # The sampled tokens the next step reads, and the host too, are whole on every device.
    assert engine.runner.device.prev_tokens.sharding.is_fully_replicated


@pytest.mark.slow
def test_no_compile_after_warm_up(checkpoint: Callable[..., Path]) -> None:
    with eSurge(checkpoint("llama"), engine_config(), show_progress=False,
                parallel_config=ParallelConfig(2)) as llm:
        before = tuple(f._cache_size() for f in (model_step, sample_step, prompt_logprobs_step))
        llm.generate(mixed_prompts(8, vocab=250), [
            SamplingParams(temperature=0, max_tokens=8),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8),
            SamplingParams(temperature=0, logprobs=2, max_tokens=8, prompt_logprobs=1),
            SamplingParams(temperature=1.0, frequency_penalty=0.5, max_tokens=8),
        ] * 2)
        after = tuple(f._cache_size() for f in (model_step, sample_step, prompt_logprobs_step))
    assert after == before


def test_each_device_reads_only_its_slice(checkpoint: Callable[..., Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from esurge.models.checkpoint import HFDirectorySource
    from esurge.models.loader import load_model

    reads: list[tuple[str, int]] = []
    whole: list[str] = []
    read_slice, read = HFDirectorySource.read_slice, HFDirectorySource.read

    def spy_slice(self: HFDirectorySource, name: str, index: tuple[slice, ...]) -> object:
        out = read_slice(self, name, index)
        reads.append((name, out.size))
        return out

    def spy_read(self: HFDirectorySource, name: str) -> object:
        whole.append(name)
        return read(self, name)

    monkeypatch.setattr(HFDirectorySource, "read_slice", spy_slice)
    monkeypatch.setattr(HFDirectorySource, "read", spy_read)
    path = checkpoint("llama", num_attention_heads=8, num_key_value_heads=4)
    model = load_model(path, tensor_parallel_size=4)
    sizes = {name: math.prod(HFDirectorySource(path).tensor_shape(name)) for name, _ in reads}
    # Every split tensor is read a quarter at a time, by each of the 4 devices
    # (with dual layouts, twice: panels and plain weight); only the norms whole.
    split = [(name, size) for name, size in reads if not name.endswith("norm.weight")]
    assert [(n, s, sizes[n]) for n, s in split if s * 4 != sizes[n]] == []
    projections = {f"model.layers.{i}.{m}.{p}_proj.weight" for i in range(2)
                   for m, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                   for p in names}
    assert {name for name, _ in split} == projections | {"model.embed_tokens.weight",
                                                         "lm_head.weight"}
    assert whole and all(name.endswith("norm.weight") for name in whole)
    assert all(leaf.sharding.mesh is model.mesh  # type: ignore[attr-defined]
               for leaf in jax.tree_util.tree_leaves(model.params))
