"""The Eagle draft head as Flax nnx modules, named like the published checkpoints.

Module paths are the checkpoint's tensor names (`fc.weight`,
`layers.0.self_attn.q_proj.weight`, `midlayer.hidden_norm.weight`, ...), so
loading is a walk over the parameter tree. Attention is left to the caller
through an `Attend` callable: the engine attends over the paged draft cache,
the trainer over a dense mask, and the projections stay the same code.

One draft step maps (hidden [T, H], token embeddings [T, H]) to a new hidden
state [T, H]:
- EAGLE-1: x = fc([embedding; hidden]), then the decoder layers (the first
  without its input norm). Logits come from the target's LM head.
- EAGLE-3: one midlayer over [input_layernorm(embedding); hidden_norm(hidden)]
  with `hidden` as the residual; logits = lm_head(norm(x)) over the draft
  vocabulary. Its first hidden input is fc over the three fused target layers.
The returned hidden state is what the next step consumes.

Serving may store every projection packed in column panels (`HeadWeights`,
esurge.models.packed_linear), so the head multiplies in the same CPU kernels
as the target (float32, or bfloat16 where the CPU has it; a float32 head
of bfloat16 values in widened panels) instead of XLA's matmuls; training
keeps the checkpoint's [out, in] layout.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.models.coded_linear import CodedLinear
from esurge.models.decoder_config import WIDENED_BITS, Activation
from esurge.models.forward import HashedGraph
from esurge.models.layers import Embedding, Linear, RMSNorm
from esurge.models.packed_linear import PackedLinear
from esurge.models.rope import apply_rope
from esurge.spec_decode.config import EagleConfig, EagleLayout

__all__ = ["Attend", "EagleHead", "EagleState", "HeadParams", "HeadWeights", "init_head"]

# attend(layer index, q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D]) -> [T, heads, D]
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]
HeadParams = dict[str, Any]  # nested {module name: ... {param name: array}}


def _activate(kind: Activation, x: jax.Array) -> jax.Array:
    if kind is Activation.SILU:
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=kind is Activation.GELU_TANH)


class HeadWeights(Enum):
    """How the head's projections are stored, chosen at load like the target's."""

    PLAIN = "plain"  # the checkpoint's [out, in]: XLA's matmuls (training)
    PANELS = "panels"  # column panels for the CPU kernels
    # Panels for small buckets and input-major weights for larger ones (XLA's
    # matmul), as a dual-layout target keeps them (CPUs without AVX-512).
    DUAL = "dual"
    # PANELS and DUAL for a float32 head whose values are all bfloat16 (as
    # heads ship): the panels keep them in two bytes and the kernel widens
    # them in registers (cpu_kernels/widened_matmul.cc), the same products.
    WIDENED = "widened"
    WIDENED_DUAL = "widened-dual"

    @property
    def dual(self) -> bool:
        """Input-major weights kept beside the panels, for large buckets."""
        return self in (HeadWeights.DUAL, HeadWeights.WIDENED_DUAL)

    @property
    def widened(self) -> bool:
        """The panels hold bfloat16 values multiplied in float32."""
        return self in (HeadWeights.WIDENED, HeadWeights.WIDENED_DUAL)

    def widen(self) -> HeadWeights:
        """The widened form of a panel layout (PLAIN has none: itself)."""
        return {HeadWeights.PANELS: HeadWeights.WIDENED,
                HeadWeights.DUAL: HeadWeights.WIDENED_DUAL}.get(self, self)


HeadLinear = Linear | PackedLinear | CodedLinear


def _linear(in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype,
            weights: HeadWeights) -> HeadLinear:
    if weights is HeadWeights.PLAIN:
        return Linear(in_features, out_features, bias=bias, dtype=dtype)
    if weights.widened:
        return CodedLinear(in_features, out_features, bits=WIDENED_BITS, bias=bias, dtype=dtype,
                           dual=weights.dual)
    return PackedLinear(in_features, out_features, bias=bias, dtype=dtype, dual=weights.dual)


def _norm(dim: int, config: EagleConfig, dtype: jnp.dtype) -> RMSNorm:
    return RMSNorm(dim, eps=config.rms_norm_eps, offset=False, dtype=dtype)


class _MLP(nnx.Module):
    def __init__(self, config: EagleConfig, *, dtype: jnp.dtype, weights: HeadWeights):
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = _linear(h, i, bias=bias, dtype=dtype, weights=weights)
        self.up_proj = _linear(h, i, bias=bias, dtype=dtype, weights=weights)
        self.down_proj = _linear(i, h, bias=bias, dtype=dtype, weights=weights)
        self.activation = config.activation

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, H]
        gated = (_activate(self.activation, self.gate_proj(x, num_rows))
                 * self.up_proj(x, num_rows))
        return self.down_proj(gated, num_rows)


class _Attention(nnx.Module):
    def __init__(self, in_features: int, config: EagleConfig, *, dtype: jnp.dtype,
                 weights: HeadWeights):
        d, bias = config.head_dim, config.attention_bias
        heads, kv_heads = config.num_heads * d, config.num_kv_heads * d
        self.q_proj = _linear(in_features, heads, bias=bias, dtype=dtype, weights=weights)
        self.k_proj = _linear(in_features, kv_heads, bias=bias, dtype=dtype, weights=weights)
        self.v_proj = _linear(in_features, kv_heads, bias=bias, dtype=dtype, weights=weights)
        self.o_proj = _linear(heads, config.hidden_size, bias=bias, dtype=dtype, weights=weights)
        self.shape = (config.num_heads, config.num_kv_heads, d)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], attend: Attend,
                 layer: int, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # x: [T, in_features] -> [T, H]
        heads, kv_heads, d = self.shape
        t = x.shape[0]
        q = apply_rope(self.q_proj(x, num_rows).reshape(t, heads, d), *rope)
        k = apply_rope(self.k_proj(x, num_rows).reshape(t, kv_heads, d), *rope)
        v = self.v_proj(x, num_rows).reshape(t, kv_heads, d)
        return self.o_proj(attend(layer, q, k, v).reshape(t, heads * d), num_rows)


class _Eagle1Layer(nnx.Module):
    """A Llama decoder layer; EAGLE-1 drops the input norm of layer 0."""

    def __init__(self, config: EagleConfig, index: int, *, dtype: jnp.dtype, weights: HeadWeights):
        h = config.hidden_size
        self.input_layernorm = _norm(h, config, dtype) if index > 0 else None
        self.self_attn = _Attention(h, config, dtype=dtype, weights=weights)
        self.post_attention_layernorm = _norm(h, config, dtype)
        self.mlp = _MLP(config, dtype=dtype, weights=weights)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], attend: Attend,
                 layer: int, num_rows: jax.Array | None = None) -> jax.Array:  # [T, H]
        normed = x if self.input_layernorm is None else self.input_layernorm(x)
        x = x + self.self_attn(normed, rope, attend, layer, num_rows)
        return x + self.mlp(self.post_attention_layernorm(x), num_rows)


class _Eagle3Layer(nnx.Module):
    """The EAGLE-3 midlayer: attention over [normed embedding; normed hidden]."""

    def __init__(self, config: EagleConfig, *, dtype: jnp.dtype, weights: HeadWeights):
        h = config.hidden_size
        self.input_layernorm = _norm(h, config, dtype)
        self.hidden_norm = _norm(h, config, dtype)
        self.self_attn = _Attention(2 * h, config, dtype=dtype, weights=weights)
        self.post_attention_layernorm = _norm(h, config, dtype)
        self.mlp = _MLP(config, dtype=dtype, weights=weights)
        self.norm_before_residual = config.norm_before_residual

    def __call__(self, hidden: jax.Array, embeds: jax.Array, rope: tuple[jax.Array, jax.Array],
                 attend: Attend, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, H], [T, H] -> [T, H]
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        x = residual + self.self_attn(x, rope, attend, 0, num_rows)
        return x + self.mlp(self.post_attention_layernorm(x), num_rows)


class EagleHead(nnx.Module):
    """An EAGLE-1 or EAGLE-3 draft head (see the module docstring)."""

    def __init__(self, config: EagleConfig, *, dtype: jnp.dtype, own_embedding: bool = False,
                 weights: HeadWeights = HeadWeights.PLAIN):
        self.config = config
        # Inputs from the target (its features, a float32 hidden) are cast to this
        # on entry: a bfloat16 head then multiplies in the CPU's bfloat16 kernels.
        self.dtype = jnp.dtype(dtype)
        h = config.hidden_size
        self.embed_tokens = (Embedding(config.vocab_size, h, dtype=dtype)
                             if own_embedding else None)
        if config.layout is EagleLayout.EAGLE1:
            self.fc = _linear(2 * h, h, bias=config.fc_bias, dtype=dtype, weights=weights)
            self.layers = nnx.List([_Eagle1Layer(config, i, dtype=dtype, weights=weights)
                                    for i in range(config.num_layers)])
        else:
            self.fc = _linear(config.feature_size, h, bias=False, dtype=dtype, weights=weights)
            self.midlayer = _Eagle3Layer(config, dtype=dtype, weights=weights)
            self.norm = _norm(h, config, dtype)
            self.lm_head = _linear(h, config.draft_vocab_size, bias=False, dtype=dtype,
                                   weights=weights)

    def embed(self, ids: jax.Array, target: Any) -> jax.Array:  # [T] -> [T, H]
        """Token embeddings: the head's own table if it has one, else the target's."""
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return target.model.embed_tokens(ids)

    def first_hidden(self, features: jax.Array, num_rows: jax.Array | None = None
                     ) -> jax.Array:  # [T, F] -> [T, H]
        """The hidden input of the first draft step from the target's features
        (num_rows: rows at and past it are padding, which packed projections skip)."""
        if self.config.layout is EagleLayout.EAGLE3:
            return self.fc(features.astype(self.dtype), num_rows)
        return features.astype(self.dtype)

    def step(self, hidden: jax.Array, embeds: jax.Array, rope: tuple[jax.Array, jax.Array],
             attend: Attend, num_rows: jax.Array | None = None
             ) -> jax.Array:  # [T, H], [T, H] -> [T, H]
        """One draft step; the result feeds the next step and the LM head. Packed
        projections skip rows at and past num_rows (padding)."""
        if self.config.layout is EagleLayout.EAGLE3:
            return self.midlayer(hidden, embeds.astype(hidden.dtype), rope, attend, num_rows)
        x = self.fc(jnp.concatenate([embeds.astype(hidden.dtype), hidden], axis=-1), num_rows)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, attend, i, num_rows)
        return x

    def logits(self, hidden: jax.Array, target: Any, num_rows: jax.Array | None = None
               ) -> jax.Array:
        """[T, H] -> [T, draft_vocab] float32 (the target's LM head for EAGLE-1);
        packed projections skip rows at and past num_rows (their logits are zeros)."""
        if self.config.layout is EagleLayout.EAGLE3:
            return self.lm_head(self.norm(hidden), num_rows).astype(jnp.float32)
        return target.compute_logits(hidden, num_rows)


class EagleState:
    """A draft head as a pytree: static graph definition, parameters and the d2t map.

    d2t [draft_vocab] int32 maps a draft token d to target token d + d2t[d]
    (zeros for EAGLE-1, whose vocabulary is the target's).
    """

    __slots__ = ("_static", "d2t", "params")

    def __init__(self, graphdef: nnx.GraphDef[EagleHead], params: HeadParams,
                 d2t: jax.Array) -> None:
        self._static = HashedGraph(graphdef)
        self.params = params
        self.d2t = d2t

    @property
    def graphdef(self) -> nnx.GraphDef[EagleHead]:
        """The static nnx graph definition."""
        return self._static.graphdef

    def module(self) -> EagleHead:
        """The nnx module holding these parameters."""
        return nnx.merge(self.graphdef, self.params)

    @property
    def config(self) -> EagleConfig:
        """The head's static configuration."""
        return self.module().config

    def replace_params(self, params: HeadParams) -> EagleState:
        """The same head with other parameter values (training)."""
        state = EagleState.__new__(EagleState)
        state._static, state.params, state.d2t = self._static, params, self.d2t
        return state

    def _flatten(self) -> tuple[tuple[HeadParams, jax.Array], HashedGraph]:
        return (self.params, self.d2t), self._static

    @classmethod
    def _unflatten(cls, static: HashedGraph, children: tuple[HeadParams, jax.Array]
                   ) -> EagleState:
        state = cls.__new__(cls)
        state._static = static
        state.params, state.d2t = children
        return state


jax.tree_util.register_pytree_node(EagleState, EagleState._flatten, EagleState._unflatten)


def init_head(config: EagleConfig, *, seed: int, dtype: str = "float32",
              d2t: jax.Array | None = None, scale: float = 0.02) -> EagleState:
    """A freshly initialised head: normal(0, scale) matrices, unit norms, zero biases.

    d2t [draft_vocab] defaults to zeros (draft vocabulary = target vocabulary prefix).
    """
    jdtype = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: EagleHead(config, dtype=jdtype))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    values = []
    for (path, leaf), key in zip(leaves, keys, strict=True):
        name = str(getattr(path[-1], "key", path[-1]))
        if len(leaf.shape) == 1:
            values.append(jnp.full(leaf.shape, 1.0 if name == "weight" else 0.0, jdtype))
        else:
            values.append((scale * jax.random.normal(key, leaf.shape)).astype(jdtype))
    params = jax.tree_util.tree_unflatten(treedef, values)
    if d2t is None:
        d2t = jnp.zeros(config.draft_vocab_size, jnp.int32)
    return EagleState(graphdef, params, jnp.asarray(d2t, jnp.int32))
