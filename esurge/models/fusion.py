"""Fuse a loaded checkpoint's projections into the serving layout.

Checkpoints load in the Hugging Face layout (q_proj, k_proj, v_proj,
gate_proj, up_proj, each [out, in]). For serving, q/k/v become one
`qkv_proj` and gate/up one `gate_up_proj`, stored input-major ([in, out]):
on XLA:CPU a decode step's narrow matmuls are launch- and packing-bound, and
one wide matmul over the concatenated weight computes the same dot products
in less time. The outputs are split again right after the matmul, so nothing
downstream changes. A layout cut for tensor parallelism
(`DecoderConfig.tensor_parallel`) groups the fused columns per shard,
[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 ...], so a column-parallel split of the
fused weight hands each device its own heads whole.

`pack_projections` goes one step further where the CPU kernels serve: every
projection and the untied LM head are stored in column panels
(esurge.models.packed_linear) for the few-row matmul kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.models.coded_layout import CodedPanels
from esurge.models.decoder import CausalLM
from esurge.models.decoder_config import WIDENED_BITS, DecoderConfig
from esurge.models.forward import ModelState, Params
from esurge.models.packed_linear import pack_gate_up, pack_weight

__all__ = ["coded_config", "fuse_layer", "fuse_projections", "pack_layer", "pack_lm_head",
           "pack_per_shard", "pack_projections", "packed_config", "state_for"]


def _by_shard(arrays: list[jax.Array], shards: int) -> jax.Array:
    """[out_i, ...] arrays -> [sum(out_i), ...], shard-major: shard j's rows of
    every array, then shard j + 1's (one shard: a plain concatenation)."""
    split = [a.reshape(shards, -1, *a.shape[1:]) for a in arrays]
    joined = jnp.concatenate(split, axis=1)
    return joined.reshape(-1, *arrays[0].shape[1:])


def _concat(parts: list[dict[str, Any]], shards: int) -> dict[str, Any]:
    """[out_i, in] weights (and [out_i] biases) -> one [in, sum(out_i)] weight,
    its columns grouped per shard ([q_0 | k_0 | v_0 | q_1 | ...])."""
    fused = {"weight": _by_shard([p["weight"] for p in parts], shards).T}
    if parts[0].get("bias") is not None:
        fused["bias"] = _by_shard([p["bias"] for p in parts], shards)
    return fused


def fuse_layer(layer: dict[str, Any], shards: int) -> dict[str, Any]:
    """One decoder layer's subtree with q/k/v and gate/up fused (grouped per shard)."""
    attn, mlp = dict(layer["self_attn"]), dict(layer["mlp"])
    attn["qkv_proj"] = _concat([attn.pop("q_proj"), attn.pop("k_proj"), attn.pop("v_proj")],
                               shards)
    mlp["gate_up_proj"] = _concat([mlp.pop("gate_proj"), mlp.pop("up_proj")], shards)
    return {**layer, "self_attn": attn, "mlp": mlp}


def fuse_projections(config: DecoderConfig, state: ModelState, dtype: jnp.dtype
                     ) -> tuple[DecoderConfig, ModelState]:
    """The same model with fused q/k/v and gate/up projections (config and state)."""
    if config.fused_projections:
        return config, state
    fused_config = dataclasses.replace(config, fused_projections=True)
    params = _map_layers(state.params, lambda layer: fuse_layer(layer, config.tensor_parallel))
    return fused_config, state_for(fused_config, params, dtype)


def _map_layers(params: Params, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Params:
    """A shallow copy of params with every decoder layer's subtree changed."""
    model = dict(params["model"])
    model["layers"] = {i: change(layer) for i, layer in model["layers"].items()}
    return {**params, "model": model}


def pack_per_shard(pack: Callable[[jax.Array], jax.Array], weight: jax.Array,  # [in, out]
                   shards: int) -> jax.Array:
    """Each shard's block of columns packed on its own, the packs concatenated
    (panel axis first), so splitting the panels evenly hands each shard its own."""
    blocks = jnp.split(weight, shards, axis=1)
    return jnp.concatenate([pack(block) for block in blocks], axis=0)


def _packed(linear: dict[str, Any], input_major: bool, dual: bool,
            shards: int = 1) -> dict[str, Any]:
    """A linear's weight packed; column-parallel ones (shards > 1) per shard."""
    weight = linear["weight"] if input_major else linear["weight"].T
    packed = {**linear, "weight": pack_per_shard(pack_weight, weight, shards)}
    if dual:
        packed["plain"] = weight
    return packed


_INPUT_MAJOR = frozenset({"qkv_proj", "gate_up_proj"})  # fused, so already [in, out]


def _coded(linear: dict[str, Any], panels: dict[str, Any], input_major: bool,
           dual: bool) -> dict[str, Any]:
    """A linear whose panels hold codes (esurge.models.coded_linear); dual keeps
    its float32 weight input-major beside them."""
    coded: dict[str, Any] = {"weight": {k: jnp.asarray(v) for k, v in panels.items()}}
    if dual:
        coded["plain"] = linear["weight"] if input_major else linear["weight"].T
    if linear.get("bias") is not None:
        coded["bias"] = linear["bias"]
    return coded


def _widened(config: DecoderConfig, role: str, linear: dict[str, Any], dual: bool
             ) -> dict[str, Any]:
    """A linear served from bfloat16 panels (WIDENED_BITS): its float32 panels,
    rounded back to bfloat16, which is exact since the weight was read from
    bfloat16 (esurge.models.coded_layout.widened_roles); dual keeps the
    float32 weight input-major beside them."""
    input_major = role in _INPUT_MAJOR
    weight = linear["weight"] if input_major else linear["weight"].T
    panels = (pack_gate_up(weight, config.intermediate_size) if role == "gate_up_proj"
              else pack_weight(weight))
    return _coded(linear, {"panels": panels.astype(jnp.bfloat16)}, input_major, dual)


def _float_gate_up(config: DecoderConfig, linear: dict[str, Any]) -> dict[str, Any]:
    """The fused gate/up in float32 panels: SiLU panels where the kernel applies
    the activation, plain column panels otherwise (per shard)."""
    dual, shards = config.dual_layout, config.tensor_parallel
    if not config.fused_gate_activation:
        return _packed(linear, input_major=True, dual=dual, shards=shards)
    weight = linear["weight"]
    local = config.intermediate_size // shards
    panels = pack_per_shard(lambda block: pack_gate_up(block, local), weight, shards)
    return {"weight": panels, **({"plain": weight} if dual else {})}


def pack_layer(config: DecoderConfig, layer: dict[str, Any],
               coded: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One fused layer's projections packed (config: the packed serving config):
    the roles of config.coded_weights from their coded panels (`coded`, role
    -> panels), the others in float32 panels.

    Column-parallel projections (q/k/v, gate/up) are packed per shard; the
    row-parallel ones (o, down) whole, their panels then split by input rows.
    """
    attn, mlp = dict(layer["self_attn"]), dict(layer["mlp"])
    dual, shards = config.dual_layout, config.tensor_parallel
    float_packs: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "qkv_proj": lambda lin: _packed(lin, input_major=True, dual=dual, shards=shards),
        "o_proj": lambda lin: _packed(lin, input_major=False, dual=dual),
        "gate_up_proj": lambda lin: _float_gate_up(config, lin),
        "down_proj": lambda lin: _packed(lin, input_major=False, dual=dual),
    }
    for role, module in (("qkv_proj", attn), ("o_proj", attn), ("gate_up_proj", mlp),
                         ("down_proj", mlp)):
        if config.code_bits(role) == WIDENED_BITS:
            module[role] = _widened(config, role, module[role], dual)
        elif config.code_bits(role) is not None and coded is not None:
            module[role] = _coded(module[role], coded[role], role in _INPUT_MAJOR, dual)
        else:
            module[role] = float_packs[role](module[role])
    return {**layer, "self_attn": attn, "mlp": mlp}


def pack_lm_head(config: DecoderConfig, lm_head: dict[str, Any]) -> dict[str, Any]:
    """The untied LM head packed (vocab-parallel: per shard)."""
    return _packed(lm_head, input_major=False, dual=config.dual_layout,
                   shards=config.tensor_parallel)


def packed_config(config: DecoderConfig, dual: bool,
                  dtype: jnp.dtype = jnp.float32) -> DecoderConfig:
    """The fused config with packed weights (dual: plain weights kept too; a
    tied head gets panels of its own in bfloat16 on one device)."""
    if not config.fused_projections:
        raise ValueError("packed weights need the fused layout")
    tied_head = (jnp.dtype(dtype) == jnp.bfloat16 and config.tie_word_embeddings and not dual
                 and config.tensor_parallel == 1)
    return dataclasses.replace(config, packed_weights=True, dual_layout=dual,
                               packed_tied_head=tied_head)


def coded_config(packed: DecoderConfig, coded_weights: tuple[tuple[str, int], ...]
                 ) -> DecoderConfig:
    """The packed config with these roles served from a checkpoint's codes (a
    tied head then gets no panels of its own: the coded head serves it)."""
    if not coded_weights:
        return packed
    return dataclasses.replace(packed, coded_weights=coded_weights, packed_tied_head=False)


def pack_projections(config: DecoderConfig, state: ModelState, dtype: jnp.dtype,
                     dual: bool = False, coded: CodedPanels | None = None
                     ) -> tuple[DecoderConfig, ModelState]:
    """The fused model with every projection and the untied LM head packed;
    dual keeps each input-major weight beside its panels (DecoderConfig.dual_layout);
    coded: the roles to serve from a GGUF's codes (esurge.models.coded_layout)."""
    if not config.fused_projections:
        config, state = fuse_projections(config, state, dtype)
    if config.packed_weights:
        return config, state
    packed = packed_config(config, dual, dtype)
    if coded is not None:
        packed = coded_config(packed, coded.coded_weights)
    model = dict(state.params["model"])
    model["layers"] = {i: pack_layer(packed, layer, coded.layers[int(i)] if coded else None)
                       for i, layer in model["layers"].items()}
    params = {**state.params, "model": model}
    untied = params.get("lm_head") or {"weight": params["model"]["embed_tokens"]["weight"]}
    head_dual = packed.dual_layout and not packed.tie_word_embeddings  # (see CausalLM)
    if packed.code_bits("lm_head") == WIDENED_BITS:
        params["lm_head"] = _widened(packed, "lm_head", untied, head_dual)
    elif coded is not None and coded.lm_head is not None:
        params["lm_head"] = _coded(untied, coded.lm_head, input_major=False, dual=head_dual)
    elif params.get("lm_head") is not None:
        params["lm_head"] = pack_lm_head(packed, params["lm_head"])
    elif packed.packed_tied_head:
        params["lm_head"] = pack_lm_head(packed, {"weight": model["embed_tokens"]["weight"]})
    return packed, state_for(packed, params, dtype)


def state_for(config: DecoderConfig, params: Params, dtype: jnp.dtype) -> ModelState:
    """params under the module tree of config, checked against it (ValueError)."""
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype))
    graphdef, abstract_params = nnx.split(abstract)
    _check_same_tree(nnx.to_pure_dict(abstract_params), params)
    return ModelState(graphdef=graphdef, params=params)


def _check_same_tree(expected: Any, got: Any, path: str = "") -> None:
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            raise ValueError(f"fused parameters at {path or '<root>'} do not match the fused "
                             f"module: {sorted(map(str, got))} vs {sorted(map(str, expected))}")
        for key in expected:
            _check_same_tree(expected[key], got[key], f"{path}.{key}" if path else str(key))
    elif tuple(expected.shape) != tuple(got.shape):
        raise ValueError(f"fused parameter {path} has shape {tuple(got.shape)}, "
                         f"expected {tuple(expected.shape)}")
