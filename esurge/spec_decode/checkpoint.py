"""Load and save Eagle draft heads as Hugging Face style directories.

A head directory holds config.json and its weights, either `*.safetensors`
(optionally with `model.safetensors.index.json`) or the `pytorch_model.bin`
the reference EAGLE releases ship (read with torch's weights-only loader,
when torch is installed). The layout is told by the tensor names: `midlayer.*`
or `d2t` mean EAGLE-3 (vLLM's `layers.0.*` spelling of the midlayer is
accepted too), `layers.N.*` with `fc.weight` mean EAGLE-1. Every expected
tensor must be present with its exact shape, and nothing unexpected may be
left over; a violation is a ValueError naming the tensor.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from esurge.models.cpu_kernels import kernels_serve, widened_panels_enabled
from esurge.models.decoder_config import DecoderConfig
from esurge.models.packed_linear import pack_weight
from esurge.spec_decode.config import EagleConfig, EagleLayout
from esurge.spec_decode.head import EagleHead, EagleState, HeadParams, HeadWeights

__all__ = ["eagle_config_dict", "head_serving_dtype", "head_weights", "load_eagle_head",
           "read_tensors", "save_eagle_head"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Buffers some exporters write that carry no learned state.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a head directory as float32/int/bool numpy arrays."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        out: dict[str, np.ndarray] = {}
        for file in files:
            with safe_open(str(file), framework="flax") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = handle.get_tensor(name)
                    if jnp.issubdtype(tensor.dtype, jnp.floating):
                        tensor = tensor.astype(jnp.float32)
                    out[name] = np.asarray(tensor)
        return out
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"no *.safetensors or pytorch_model.bin in draft directory {path}")
    try:
        import torch
    except ImportError as exc:
        raise ValueError(f"{bins[0].name} needs torch to read; convert the draft head in {path} "
                         "to safetensors or install torch") from exc
    out = {}
    for file in bins:
        for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
            value = tensor.float() if tensor.is_floating_point() else tensor
            out[name] = value.numpy()
    return out


def _detect_layout(names: set[str], path: Path) -> EagleLayout:
    if any(n.startswith("midlayer.") for n in names) or "d2t" in names:
        return EagleLayout.EAGLE3
    if "fc.weight" in names and any(n.startswith("layers.") for n in names):
        return EagleLayout.EAGLE1
    raise ValueError(f"draft directory {path} holds neither an EAGLE-1 head (fc.weight, "
                     "layers.N.*) nor an EAGLE-3 head (midlayer.*, d2t)")


def _canonical(tensors: dict[str, np.ndarray], layout: EagleLayout) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if layout is EagleLayout.EAGLE3 and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out[name] = value
    return out


def _flat_names(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat_names(value, name + "."))
        else:
            out[name] = value
    return out


def _fill(abstract: HeadParams, tensors: dict[str, np.ndarray], dtype: jnp.dtype,
          path: Path) -> HeadParams:
    def load(keys: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = ".".join(str(getattr(k, "key", k)) for k in keys)
        if name not in tensors:
            raise ValueError(f"draft head in {path} is missing tensor {name!r}")
        value = tensors.pop(name)
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(f"draft tensor {name!r} has shape {tuple(value.shape)}, expected "
                             f"{tuple(leaf.shape)}")
        return jnp.asarray(value, dtype=dtype)

    return jax.tree_util.tree_map_with_path(load, abstract)


def _vocab_maps(tensors: dict[str, np.ndarray], config: EagleConfig) -> jax.Array:
    """Check and return d2t [draft_vocab] int32; t2d must agree with it."""
    vd, v = config.draft_vocab_size, config.vocab_size
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    if d2t is None:
        if vd != v:
            raise ValueError(f"draft_vocab_size {vd} differs from vocab_size {v} but the head "
                             "has no 'd2t' tensor")
        d2t = np.zeros(vd, np.int64)
    if d2t.shape != (vd,):
        raise ValueError(f"draft tensor 'd2t' has shape {d2t.shape}, expected ({vd},)")
    target_ids = np.arange(vd) + d2t.astype(np.int64)
    if target_ids.min() < 0 or target_ids.max() >= v or len(set(target_ids.tolist())) != vd:
        raise ValueError(f"draft tensor 'd2t' maps draft ids outside [0, {v}) or onto one "
                         "target id twice")
    if t2d is not None:
        if t2d.shape != (v,):
            raise ValueError(f"draft tensor 't2d' has shape {t2d.shape}, expected ({v},)")
        expected = np.zeros(v, bool)
        expected[target_ids] = True
        if not np.array_equal(t2d.astype(bool), expected):
            raise ValueError("draft tensor 't2d' does not mark exactly the target ids of 'd2t'")
    return jnp.asarray(d2t, jnp.int32)


def _projections(params: HeadParams) -> list[jax.Array]:
    """Every projection's [out, in] weight (the embedding is no projection)."""
    found = []
    for name, value in params.items():
        if isinstance(value, dict):
            found += _projections(value) if name != "embed_tokens" else []
        elif name == "weight" and value.ndim == 2:
            found.append(value)
    return found


def _bfloat16_values(params: HeadParams) -> bool:
    """True when every projection holds bfloat16 values (exact in two bytes)."""
    return all(bool(jnp.array_equal(w, w.astype(jnp.bfloat16).astype(w.dtype)))
               for w in _projections(params))


def _packed_params(params: HeadParams, weights: HeadWeights) -> HeadParams:
    """Every projection's [out, in] weight as column panels (PackedLinear's
    layout; widened: bfloat16 panels, CodedLinear's), and with a dual layout
    also input-major (its `plain`)."""
    out: HeadParams = {}
    for name, value in params.items():
        if isinstance(value, dict):
            out[name] = _packed_params(value, weights) if name != "embed_tokens" else value
        elif name == "weight" and value.ndim == 2:
            panels = pack_weight(value.T)
            out[name] = {"panels": panels.astype(jnp.bfloat16)} if weights.widened else panels
            if weights.dual:
                out["plain"] = value.T
        else:
            out[name] = value
    return out


def head_weights(target: DecoderConfig, *, on_mesh: bool) -> HeadWeights:
    """The head's projections in its target's layout: on one device, the CPU
    kernels' panels where the target is packed (SmolLM2's head at 1 and 5 rows
    on a 2-core AVX2 EPYC: 0.45-0.65 of XLA's matmul time), beside input-major
    weights for large buckets where the target keeps both (no AVX-512)."""
    if on_mesh or not target.packed_weights:
        return HeadWeights.PLAIN
    return HeadWeights.DUAL if target.dual_layout else HeadWeights.PANELS


def head_serving_dtype(model_dtype: str, weights: HeadWeights) -> str:
    """The dtype to serve a head in beside a target served in `model_dtype`:
    bfloat16 under a float32 target where the CPU kernels multiply bfloat16
    natively. A draft pass is bound by reading the head's weights (SmolLM2's
    head: 35 MB in float32, more than a third of its 4-bit target's step),
    and drafts need only be likely, not exact: verification decides every token."""
    if (weights is not HeadWeights.PLAIN and model_dtype == "float32"
            and kernels_serve(jnp.bfloat16)):
        return "bfloat16"
    return model_dtype


def load_eagle_head(path: str | Path, target: DecoderConfig, dtype: str = "float32",
                    weights: HeadWeights = HeadWeights.PLAIN) -> EagleState:
    """Load the Eagle head in `path` for a target model of configuration `target`,
    its projections stored as `weights` says (panels for the CPU kernels: serving;
    in float32, a head of bfloat16 values gets widened panels, HeadWeights.widen)."""
    path = Path(path)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"draft directory {path} has no config.json")
    tensors = read_tensors(path)
    layout = _detect_layout(set(tensors), path)
    tensors = _canonical(tensors, layout)
    config = EagleConfig.from_hf_dict(json.loads(config_file.read_text()), layout,
                                      target.num_layers)
    if layout is EagleLayout.EAGLE1 and "fc.bias" in tensors:
        config = replace(config, fc_bias=True)
    _check_against_target(config, target)
    own_embedding = "embed_tokens.weight" in tensors and layout is EagleLayout.EAGLE3
    if not own_embedding:
        embed = tensors.pop("embed_tokens.weight", None)
        if embed is not None and embed.shape != (target.vocab_size, target.hidden_size):
            raise ValueError(f"draft tensor 'embed_tokens.weight' has shape {embed.shape}, "
                             f"expected {(target.vocab_size, target.hidden_size)}")
    if not own_embedding and config.hidden_size != target.hidden_size:
        raise ValueError(f"draft hidden_size {config.hidden_size} differs from the target's "
                         f"{target.hidden_size} and the head has no own 'embed_tokens.weight'")
    d2t = _vocab_maps(tensors, config)
    jdtype = _DTYPES[dtype]
    abstract = nnx.eval_shape(lambda: EagleHead(config, dtype=jdtype,
                                                own_embedding=own_embedding))
    graphdef, abstract_state = nnx.split(abstract)
    params = _fill(nnx.to_pure_dict(abstract_state), tensors, jdtype, path)
    if tensors:
        raise ValueError(f"draft head in {path} has unexpected tensors {sorted(tensors)[:8]} "
                         f"for an {layout.value} layout")
    if weights is not HeadWeights.PLAIN:
        exact = jdtype == jnp.float32 and _bfloat16_values(params)
        if weights.widened and not exact:
            raise ValueError(f"weights={weights.value!r} needs a float32 head whose "
                             f"projections hold bfloat16 values; {path} (dtype {dtype}) "
                             "would be rounded")
        if exact and widened_panels_enabled():
            weights = weights.widen()
        graphdef, packed_state = nnx.split(nnx.eval_shape(lambda: EagleHead(
            config, dtype=jdtype, own_embedding=own_embedding, weights=weights)))
        params = _packed_params(params, weights)
        expected = jax.tree_util.tree_map(lambda a: a.shape, nnx.to_pure_dict(packed_state))
        if jax.tree_util.tree_map(lambda a: a.shape, params) != expected:
            raise ValueError("packed draft head parameters do not match its packed modules")
    return EagleState(graphdef, params, d2t)


def _check_against_target(config: EagleConfig, target: DecoderConfig) -> None:
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocab_size {config.vocab_size} differs from the target's "
                         f"{target.vocab_size}")
    if config.target_hidden_size != target.hidden_size:
        raise ValueError(f"draft target_hidden_size {config.target_hidden_size} differs from "
                         f"the target's hidden_size {target.hidden_size}")


def eagle_config_dict(target: DecoderConfig, layout: EagleLayout, *,
                      aux_layer_ids: tuple[int, ...] | None = None,
                      draft_vocab_size: int | None = None, intermediate_size: int | None = None,
                      rope_theta: float = 10000.0) -> dict[str, Any]:
    """A HF-style config.json for a new head over `target` (same attention shape)."""
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3" if layout is EagleLayout.EAGLE3
                          else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": 1 << 16,
        "bias": False,
    }
    if layout is EagleLayout.EAGLE3:
        raw["draft_vocab_size"] = draft_vocab_size or target.vocab_size
        if aux_layer_ids is not None:
            raw["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    return raw


def save_eagle_head(path: str | Path, config_json: dict[str, Any], state: EagleState,
                    dtype: str = "float32") -> Path:
    """Write config.json and model.safetensors (with d2t/t2d for EAGLE-3) into path,
    the weights as float32 or bfloat16."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = state.config
    np_dtype = np.dtype(_DTYPES[dtype])
    tensors = {name: np.asarray(value).astype(np_dtype)
               for name, value in _flat_names(state.params).items()}
    if config.layout is EagleLayout.EAGLE3:
        d2t = np.asarray(state.d2t, np.int64)
        t2d = np.zeros(config.vocab_size, bool)
        t2d[np.arange(len(d2t)) + d2t] = True
        tensors.update(d2t=d2t, t2d=t2d)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_json = {**config_json, "torch_dtype": dtype}
    (path / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return path
