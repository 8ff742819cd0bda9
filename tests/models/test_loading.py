"""Loading checkpoints: layouts that load, and every way a checkpoint is refused."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from esurge.models import SUPPORTED_ARCHITECTURES, load_model, policy_for
from esurge.models.checkpoint import MissingTensorError
from tests.models.checkpoints import save_checkpoint
from tests.models.conftest import Pair
from tests.models.paged import PagedSession, Row, hf_logits
from tests.models.test_parity import tokens

SUPPORTED = ("LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
             "Gemma2ForCausalLM, Gemma3ForCausalLM")


@pytest.fixture
def llama_copy(make_pair: Callable[..., Pair], tmp_path: Path) -> Path:
    """A private copy of the tiny Llama checkpoint, free to damage."""
    return Path(shutil.copytree(make_pair("llama").path, tmp_path / "ckpt"))


def rewrite_weights(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_registry_names_every_supported_architecture() -> None:
    assert ", ".join(SUPPORTED_ARCHITECTURES) == SUPPORTED
    assert policy_for("Qwen3ForCausalLM").qk_norm


def test_unknown_architecture_is_refused(llama_copy: Path) -> None:
    config = json.loads((llama_copy / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (llama_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_model(llama_copy)
    assert str(err.value) == f"unsupported architecture 'FancyForCausalLM'; supported: {SUPPORTED}"


def test_missing_tensor_is_named(llama_copy: Path) -> None:
    def drop(weights: dict[str, np.ndarray]) -> None:
        del weights["model.layers.1.mlp.up_proj.weight"]

    rewrite_weights(llama_copy, drop)
    with pytest.raises(MissingTensorError) as err:
        load_model(llama_copy)
    assert (err.value.path, err.value.name) == (llama_copy, "model.layers.1.mlp.up_proj.weight")


def test_misshaped_tensor_is_named(llama_copy: Path) -> None:
    def shrink(weights: dict[str, np.ndarray]) -> None:
        weights["model.norm.weight"] = weights["model.norm.weight"][:63]

    rewrite_weights(llama_copy, shrink)
    with pytest.raises(ValueError) as err:
        load_model(llama_copy)
    assert str(err.value) == "tensor 'model.norm.weight' has shape (63,), expected (64,)"


def test_pickled_checkpoints_are_not_read(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").rename(llama_copy / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        load_model(llama_copy)
    assert str(err.value) == (f"no *.safetensors files in {llama_copy} (pickled .bin "
                              "checkpoints are not supported)")


def test_bad_dtype_and_missing_config_are_refused(llama_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_model(llama_copy, dtype="float16")
    assert str(err.value) == ("dtype must be 'auto' or one of ['bfloat16', 'float32'], "
                              "got 'float16'")
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    assert str(err.value) == f"{tmp_path} has no config.json"


def test_sharded_checkpoint_loads_the_same_weights(make_pair: Callable[..., Pair],
                                                   tmp_path: Path) -> None:
    pair = make_pair("llama")
    path = save_checkpoint(pair.hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    sharded = load_model(path)
    for a, b in zip(jax.tree_util.tree_leaves(sharded.params),
                    jax.tree_util.tree_leaves(pair.loaded.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sharded.architecture == "LlamaForCausalLM" and sharded.vocab_size == 256


def test_bfloat16_load_runs_close_to_float32(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("qwen2")
    loaded = load_model(pair.path, dtype="bfloat16")
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(loaded.params)}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    session = PagedSession(loaded)
    assert session.kv.keys[0].dtype == jnp.bfloat16
    ids = tokens(50, 16)
    (got,) = session.step([Row("a", ids, 0, num_logits=16)])
    want = hf_logits(pair.hf, ids)
    assert np.abs(got - want).max() < 0.15 * np.abs(want).max()


def test_eos_ids_come_from_config_and_generation_config(llama_copy: Path) -> None:
    assert load_model(llama_copy).eos_token_ids == (2,)
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert load_model(llama_copy).eos_token_ids == (2, 7)
