"""Eagle heads load from directories laid out like the published EAGLE-1 and EAGLE-3
checkpoints (tensor names, config.json fields, .bin or safetensors), and every
mismatch is a ValueError naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from esurge.models.decoder_config import (
    Activation,
    AttentionKind,
    DecoderConfig,
    LayerAttention,
    RopeConfig,
    RopeType,
)
from esurge.spec_decode.checkpoint import load_eagle_head
from esurge.spec_decode.config import EagleLayout

H, HEADS, KV, D, FFN, V = 32, 4, 2, 8, 48, 64
TARGET = DecoderConfig(
    vocab_size=V, hidden_size=H, intermediate_size=FFN, num_heads=HEADS, num_kv_heads=KV,
    head_dim=D, rms_norm_eps=1e-5, activation=Activation.SILU,
    layers=tuple(LayerAttention(AttentionKind.FULL, None, RopeConfig(RopeType.DEFAULT, 1e4))
                 for _ in range(8)))


def _layer(prefix: str, attn_in: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(prefix))
    shapes = {
        "self_attn.q_proj.weight": (HEADS * D, attn_in),
        "self_attn.k_proj.weight": (KV * D, attn_in),
        "self_attn.v_proj.weight": (KV * D, attn_in),
        "self_attn.o_proj.weight": (H, HEADS * D),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (FFN, H),
        "mlp.up_proj.weight": (FFN, H),
        "mlp.down_proj.weight": (H, FFN),
    }
    return {f"{prefix}.{k}": rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def eagle1_tensors() -> dict[str, np.ndarray]:
    """EAGLE-1 (e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): fc over [embedding; hidden], a
    Llama layer without input_layernorm, the embedding copied from the target."""
    return {"fc.weight": np.ones((H, 2 * H), np.float32), "fc.bias": np.zeros(H, np.float32),
            "embed_tokens.weight": np.zeros((V, H), np.float32), **_layer("layers.0", H)}


def eagle3_tensors(draft_vocab: int = 40) -> dict[str, np.ndarray]:
    """EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): midlayer with hidden_norm and
    2H-wide attention, fc over three layers, norm, draft lm_head, d2t/t2d maps."""
    targets = np.arange(draft_vocab) + np.arange(draft_vocab) % 3  # ids with gaps
    targets = np.unique(targets)[:draft_vocab]
    draft_vocab = len(targets)
    t2d = np.zeros(V, bool)
    t2d[targets] = True
    tensors = {
        "fc.weight": np.ones((H, 3 * H), np.float32),
        "midlayer.hidden_norm.weight": np.ones(H, np.float32),
        "midlayer.input_layernorm.weight": np.ones(H, np.float32),
        **_layer("midlayer", 2 * H),
        "norm.weight": np.ones(H, np.float32),
        "lm_head.weight": np.zeros((draft_vocab, H), np.float32),
        "d2t": (targets - np.arange(draft_vocab)).astype(np.int64),
        "t2d": t2d,
    }
    return tensors


def config_json(layout: EagleLayout, **extra: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if layout is EagleLayout.EAGLE3
                          else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_act": "silu", "hidden_size": H,
        "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": V,
        "max_position_embeddings": 2048, "rope_theta": 500000.0, "torch_dtype": "float16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    }
    if layout is EagleLayout.EAGLE1:
        raw["bias"] = True
    return {**raw, **extra}


def write(path: Path, tensors: dict[str, np.ndarray], raw: dict[str, Any],
          as_bin: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if as_bin:
        torch.save({k: torch.from_numpy(v) for k, v in tensors.items()},
                   path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("as_bin", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_eagle1_published_layout(tmp_path: Path, as_bin: bool) -> None:
    tensors = eagle1_tensors()
    head = load_eagle_head(write(tmp_path, tensors, config_json(EagleLayout.EAGLE1), as_bin),
                           TARGET)
    config = head.config
    assert config.layout is EagleLayout.EAGLE1 and config.fc_bias
    assert config.rope.rope_type is RopeType.LLAMA3 and config.rope.factor == 8.0
    params = head.params
    # Layer 0 of EAGLE-1 has no input norm; the embedding is the target's.
    assert "input_layernorm" not in params["layers"][0] and "embed_tokens" not in params
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["mlp"]["up_proj"]["weight"]),
                                  tensors["layers.0.mlp.up_proj.weight"])
    assert np.asarray(head.d2t).tolist() == [0] * V


@pytest.mark.parametrize("spelling", ["midlayer", "layers.0"])
def test_eagle3_published_layout(tmp_path: Path, spelling: str) -> None:
    tensors = eagle3_tensors()
    if spelling != "midlayer":  # vLLM's renaming of the same tensors
        tensors = {k.replace("midlayer.", "layers.0.") if k.startswith("midlayer.") else k: v
                   for k, v in tensors.items()}
        tensors["d2t"] = eagle3_tensors()["d2t"]
    raw = config_json(EagleLayout.EAGLE3, draft_vocab_size=len(tensors["d2t"]))
    head = load_eagle_head(write(tmp_path, tensors, raw), TARGET)
    config = head.config
    assert config.layout is EagleLayout.EAGLE3
    # EAGLE-3's reference choice for an L-layer target: inputs of layers (2, L // 2, L - 3).
    assert config.aux_layer_ids == (2, 4, 5)
    draft_ids = np.arange(config.draft_vocab_size) + np.asarray(head.d2t)
    assert draft_ids.tolist() == np.flatnonzero(tensors["t2d"]).tolist()
    assert head.params["midlayer"]["self_attn"]["q_proj"]["weight"].shape == (HEADS * D, 2 * H)


def test_eagle3_layers_from_config(tmp_path: Path) -> None:
    tensors = eagle3_tensors()
    raw = config_json(EagleLayout.EAGLE3, draft_vocab_size=len(tensors["d2t"]),
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 8]})
    assert load_eagle_head(write(tmp_path, tensors, raw), TARGET).config.aux_layer_ids == (1, 5, 8)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t, r: t.pop("layers.0.mlp.up_proj.weight"), "layers.0.mlp.up_proj.weight"),
    (lambda t, r: t.__setitem__("fc.weight", np.ones((H, 3 * H), np.float32)), "'fc.weight'"),
    (lambda t, r: t.__setitem__("layers.0.extra.weight", np.ones(3, np.float32)),
     "layers.0.extra.weight"),
    (lambda t, r: (t.pop("fc.bias"), r.update(bias=True)), "fc.bias"),
    (lambda t, r: r.update(vocab_size=V + 1), "vocab_size"),
    (lambda t, r: t.__setitem__("embed_tokens.weight", np.ones((V, H + 1), np.float32)),
     "embed_tokens.weight"),
    (lambda t, r: r.update(hidden_act="relu"), "hidden_act"),
], ids=["missing", "shape", "unexpected", "bias-declared-missing", "vocab", "embedding",
        "activation"])
def test_eagle1_mismatches_name_the_problem(tmp_path: Path, edit: Any, message: str) -> None:
    tensors, raw = eagle1_tensors(), config_json(EagleLayout.EAGLE1)
    edit(tensors, raw)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_eagle_head(write(tmp_path, tensors, raw), TARGET)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t, r: t.__setitem__("t2d", ~t["t2d"]), "'t2d'"),
    (lambda t, r: t.__setitem__("d2t", t["d2t"] + V), "'d2t'"),
    (lambda t, r: t.pop("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight"),
    (lambda t, r: t.__setitem__("lm_head.weight", np.zeros((7, H), np.float32)),
     "'lm_head.weight'"),
    (lambda t, r: r.update(eagle_aux_hidden_state_layer_ids=[1, 1, 2]),
     "eagle_aux_hidden_state_layer_ids"),
    (lambda t, r: r.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]),
     "eagle_aux_hidden_state_layer_ids"),
    (lambda t, r: t.pop("d2t"), "'d2t'"),
], ids=["t2d", "d2t-range", "missing", "lm-head", "dup-layers", "layer-zero", "no-d2t"])
def test_eagle3_mismatches_name_the_problem(tmp_path: Path, edit: Any, message: str) -> None:
    tensors = eagle3_tensors()
    raw = config_json(EagleLayout.EAGLE3, draft_vocab_size=len(tensors["d2t"]))
    edit(tensors, raw)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_eagle_head(write(tmp_path, tensors, raw), TARGET)


def test_directory_problems(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_eagle_head(tmp_path, TARGET)
    (tmp_path / "config.json").write_text(json.dumps(config_json(EagleLayout.EAGLE1)))
    with pytest.raises(ValueError, match=r"no \*\.safetensors or pytorch_model\.bin"):
        load_eagle_head(tmp_path, TARGET)
    save_file({"something.weight": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="neither an EAGLE-1 head"):
        load_eagle_head(tmp_path, TARGET)
