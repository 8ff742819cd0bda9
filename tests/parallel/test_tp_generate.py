"""Tensor-parallel generation gives one device's tokens, for every family and option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from esurge import CompletionOutput, EngineSettings, ParallelConfig, SamplingParams, eSurge
from esurge.errors import InvalidConfigError
from esurge.models.cpu_kernels import cpu_has_bf16_dot
from esurge.models.loader import load_model
from esurge.spec_decode.config import EagleLayout
from tests.engine.conftest import mixed_prompts
from tests.models.gguf_export import export_gguf
from tests.parallel.conftest import GREEDY, Run, assert_same_run, engine_config, run_workload
from tests.spec_decode.helpers import AloneOnly, random_head, spec_config

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


def tp_run(path: Path, tp: int, **kwargs: object) -> Run:
    with eSurge(path, engine_config(), warmup=False, show_progress=False,
                parallel_config=ParallelConfig(tp), **kwargs) as llm:  # type: ignore[arg-type]
        assert llm.runner.mesh is not None and llm.runner.mesh.size == tp
        return run_workload(llm)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [2, 4])
def test_tokens_match_one_device(family: str, tp: int, checkpoint: Callable[..., Path],
                                 reference: Callable[..., Run]) -> None:
    # 4 query heads, 2 kv heads: TP 4 replicates each kv head twice.
    want = reference(family)
    # The pool is small enough that requests preempt each other (Mistral's
    # sliding window frees pages as it goes, so it never needs to).
    assert (want.preemptions > 0) is (family != "mistral")
    assert_same_run(tp_run(checkpoint(family), tp), want)


@pytest.mark.slow
def test_eight_way_with_a_padded_vocabulary(checkpoint: Callable[..., Path],
                                            reference: Callable[..., Run]) -> None:
    # 8 heads over 8 devices; 250 vocabulary rows padded to 256 (6 masked columns).
    shape = {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 250}
    model = load_model(checkpoint("llama", **shape), tensor_parallel_size=8)
    assert model.config.padded_vocab_size == 256 and model.vocab_size == 250
    assert_same_run(tp_run(checkpoint("llama", **shape), 8), reference("llama", **shape))


@pytest.mark.slow
def test_decode_bursts(checkpoint: Callable[..., Path], reference: Callable[..., Run]) -> None:
    got = tp_run(checkpoint("llama"), 2, settings=EngineSettings(decode_steps=4))
    assert_same_run(got, reference("llama"))


@pytest.mark.slow
def test_eagle_drafts_verify_to_the_same_tokens(tmp_path: Path,
                                                checkpoint: Callable[..., Path]) -> None:
    target = checkpoint("llama")
    head = random_head(target, tmp_path / "head", EagleLayout.EAGLE1, seed=3)
    prompts = [[5, 9, 22, 7, 3, 14, 60, 2, 8, 8, 31], [4, 8, 15, 16, 23, 42]]
    results = {}
    # (tp, async): under async scheduling the steps hand their drafts ahead, and
    # the next step's requests move back on the sharded devices.
    for tp, async_ in ((1, False), (2, False), (4, False), (2, True)):
        with eSurge(target, spec_config(2, head, async_=async_), warmup=False,
                    show_progress=False, speculation="always",
                    parallel_config=ParallelConfig(tp)) as llm:
            outs = llm.generate(prompts, GREEDY)
            stats, ahead = llm.runner.spec_stats, llm.loop.core.num_drafts_ahead
        results[tp, async_] = [o.outputs[0].token_ids for o in outs]
        assert stats is not None and stats.num_draft_tokens > 0
        assert (ahead > 0) is async_
    assert all(tokens == results[1, False] for tokens in results.values())


@pytest.mark.slow
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_request_moved_back_on_a_mesh_keeps_one_devices_tokens(
        tmp_path: Path, checkpoint: Callable[..., Path], async_: bool) -> None:
    # Drafting only alone: the long request decodes plain steps beside the three
    # short ones, then is moved back to where its head's cache stops and computes
    # those tokens again on the sharded devices (head_sync.py).
    target = checkpoint("llama")
    head = random_head(target, tmp_path / "head", EagleLayout.EAGLE1, seed=5)
    prompts = [[5, 9, 22, 7, 3, 14, 60, 2, 8], [4, 8, 15, 16, 23, 42], [7, 7, 1, 30, 2],
               [11, 3, 19, 40, 6, 2, 9]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (40, 6, 6, 6)]
    with eSurge(target, engine_config(num_pages=64), warmup=False,
                show_progress=False) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    with eSurge(target, spec_config(2, head, async_=async_), warmup=False,
                show_progress=False, parallel_config=ParallelConfig(2)) as llm:
        spec = llm.runner.spec
        assert spec is not None and llm.runner.resyncs_heads
        spec.policy = AloneOnly(prompts=True)
        free = llm.stats.num_free_pages
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [o.token_ids for o in outs] == want
        assert llm.loop.core.num_rewound >= 1
        assert outs[0].num_draft_tokens > 0
        assert not spec.sync.head_end and not spec.sync.rewound
        assert llm.stats.num_free_pages == free  # every page back


_KERNELS_OFF = """
import json, sys
from esurge import ParallelConfig, eSurge
from tests.parallel.conftest import engine_config, run_workload
out = {}
for path in sys.argv[1:]:
    for tp in (1, 2, 4):
        with eSurge(path, engine_config(), warmup=False, show_progress=False,
                    parallel_config=ParallelConfig(tp)) as llm:
            run = run_workload(llm)
        out[f"{path}@{tp}"] = [run.greedy, run.again, run.seeded]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_without_the_cpu_kernels(checkpoint: Callable[..., Path],
                                 reference: Callable[..., Run]) -> None:
    # The pure-JAX attention and XLA matmuls (nothing packed), in a process of
    # its own: the kernels are chosen once per process.
    env = {**os.environ, "ESURGE_CPU_KERNELS": "0"}
    paths = {family: str(checkpoint(family)) for family in FAMILIES}
    done = subprocess.run([sys.executable, "-c", _KERNELS_OFF, *paths.values()],
                          env=env, capture_output=True, text=True, timeout=1200,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    runs = json.loads(line.removeprefix("RESULT "))
    for family, path in paths.items():
        want = reference(family)
        for tp in (1, 2, 4):
            assert runs[f"{path}@{tp}"] == [want.greedy, want.again, want.seeded], (family, tp)


def test_more_devices_than_exist_is_refused(checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(InvalidConfigError) as err:
        load_model(checkpoint("llama"), tensor_parallel_size=16)
    assert err.value.field == "tensor_parallel_size"
    assert "16" in str(err.value) and "8" in str(err.value)


def test_heads_that_do_not_divide_are_refused(checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(InvalidConfigError) as err:
        load_model(checkpoint("llama"), tensor_parallel_size=3)
    assert err.value.field == "tensor_parallel_size"
    assert "4 attention heads" in str(err.value)


@pytest.mark.slow
def test_a_gguf_checkpoint(tmp_path: Path, checkpoint: Callable[..., Path],
                           reference: Callable[..., Run]) -> None:
    # GGUF tensors are dequantized whole and each device's slice cut from them.
    gguf_path = export_gguf(checkpoint("llama"), "llama", tmp_path / "llama.gguf")
    assert_same_run(tp_run(gguf_path, 2), reference("llama"))


# Row-parallel shards add their partial sums in float32 and round once, as one
# device does; only the order of the float32 additions differs, which can move a
# bfloat16 rounding by one unit. So a split run may take the other token only
# where one device's top two log-probabilities are this close (rounding each
# shard's partial to bfloat16 first parted runs at a gap of 0.016).
BF16_TIE = 0.01


@pytest.mark.skipif(not cpu_has_bf16_dot(), reason="bfloat16 panels need AVX512_BF16 (XLA's "
                    "bfloat16 path sums shards in another order: not this test's subject)")
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: qkv bias, a tied head
def test_bfloat16_panels_split_over_devices_keep_the_tokens(
        family: str, checkpoint: Callable[..., Path]) -> None:
    # bfloat16 panels pair their input rows; shards must cut between pairs.
    prompts = mixed_prompts(4, vocab=250)
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True,
                            logprobs=2)
    runs: dict[int, list[CompletionOutput]] = {}
    for tp in (1, 2):
        with eSurge(checkpoint(family), engine_config(), warmup=False, show_progress=False,
                    dtype="bfloat16", parallel_config=ParallelConfig(tp)) as llm:
            runs[tp] = [o.outputs[0] for o in llm.generate(prompts, params)]
            assert llm.model.dtype == "bfloat16" and llm.model.config.packed_weights
    for one, split in zip(runs[1], runs[2], strict=True):
        same = 0
        while same < len(one.token_ids) and one.token_ids[same] == split.token_ids[same]:
            same += 1
        if same < len(one.token_ids):
            top, second = one.logprobs[same].logprobs[1:3]  # the one device's best two
            assert top - second <= BF16_TIE, (family, same, top, second)
