"""The Flax nnx building blocks of the shared decoder.

Parameter names and layouts mirror the Hugging Face checkpoints (a linear
weight is [out_features, in_features]), so a module path such as
`model.layers.0.self_attn.q_proj.weight` is also the safetensors key and
loading needs no renaming or transposing. Parameters are created as zeros:
real values always come from a checkpoint, and the loader builds the module
abstractly (`nnx.eval_shape`) so they are never materialized.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.models.coded_linear import CodedGateUp, CodedLinear
from esurge.models.decoder_config import Activation, AttentionKind, DecoderConfig, LayerAttention
from esurge.models.local_shards import Split
from esurge.models.packed_linear import PackedGateUp, PackedLinear
from esurge.models.paged_attention import AttentionMetadata, write_and_attend

__all__ = [
    "MLP", "Attention", "DecoderLayer", "Embedding", "InputMajorLinear", "Linear", "RMSNorm",
    "embedding_scale", "make_norm", "serving_linear",
]


class Linear(nnx.Module):
    """y = x W^T + b with W stored [out_features, in_features] as in PyTorch."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None,
                 float32_out: bool = False
                 ) -> jax.Array:  # [..., in] -> [..., out]; num_rows, float32_out: see PackedLinear
        y = jnp.einsum("...i,oi->...o", x, self.weight[...],
                       preferred_element_type=jnp.float32 if float32_out else None)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class InputMajorLinear(nnx.Module):
    """y = x W + b with W stored [in_features, out_features].

    The layout of the fused serving projections where they are not packed
    (PackedLinear, when the CPU kernels serve): one wide matmul instead of two
    or three narrow ones, with the weight the way round XLA:CPU runs 32-row
    matmuls 10-20% faster.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None,
                 float32_out: bool = False
                 ) -> jax.Array:  # [..., in] -> [..., out]; num_rows, float32_out: see PackedLinear
        y = jnp.matmul(x, self.weight[...],
                       preferred_element_type=jnp.float32 if float32_out else None)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


AnyLinear = Linear | InputMajorLinear | PackedLinear | CodedLinear


def serving_linear(config: DecoderConfig, in_features: int, out_features: int, *, bias: bool,
                   dtype: jnp.dtype, split: Split, role: str, fused: bool = False) -> AnyLinear:
    """The projection in the config's layout: coded or float32 panels,
    input-major (a fused projection) or the checkpoint's own [out, in].
    split: how tensor parallelism cuts it (packed panels are laid out for it);
    role: its name among CODED_ROLES."""
    bits = config.code_bits(role)
    if bits is not None:
        return CodedLinear(in_features, out_features, bits=bits, bias=bias, dtype=dtype,
                           dual=config.dual_layout)
    if config.packed_weights:
        return PackedLinear(in_features, out_features, bias=bias, dtype=dtype,
                            dual=config.dual_layout, split=split,
                            shards=config.tensor_parallel)
    if fused:
        return InputMajorLinear(in_features, out_features, bias=bias, dtype=dtype)
    return Linear(in_features, out_features, bias=bias, dtype=dtype)


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((vocab_size, hidden_size), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:  # [T] -> [T, hidden]
        return jnp.take(self.weight[...], ids, axis=0)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis.

    Llama style scales the normalized input (cast back to the input dtype) by
    the weight; Gemma style (offset) scales by 1 + weight in float32 and casts
    at the end. Both as transformers computes them.
    """

    def __init__(self, dim: int, *, eps: float, offset: bool, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight = self.weight[...]
        if self.offset:
            return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        return weight * normed.astype(x.dtype)


def make_norm(dim: int, config: DecoderConfig, dtype: jnp.dtype) -> RMSNorm:
    """An RMSNorm in the model's style."""
    return RMSNorm(dim, eps=config.rms_norm_eps, offset=config.norm_offset, dtype=dtype)


def _activate(kind: Activation, x: jax.Array) -> jax.Array:
    if kind is Activation.SILU:
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=kind is Activation.GELU_TANH)


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, config: DecoderConfig, *, dtype: jnp.dtype):
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        # nnx fixes an attribute as data or static on its first assignment, so
        # each branch assigns its modules before the Nones.
        if not config.fused_projections:
            self.gate_proj: Linear | None = Linear(h, i, bias=bias, dtype=dtype)
            self.up_proj: Linear | None = Linear(h, i, bias=bias, dtype=dtype)
            self.gate_up_proj: AnyLinear | PackedGateUp | CodedGateUp | None = None
        elif (bits := config.code_bits("gate_up_proj")) is not None:
            self.gate_up_proj = CodedGateUp(h, i, bits=bits, dtype=dtype, dual=config.dual_layout)
            self.gate_proj = self.up_proj = None
        elif config.fused_gate_activation:
            self.gate_up_proj = PackedGateUp(h, i, dtype=dtype, dual=config.dual_layout,
                                             shards=config.tensor_parallel)
            self.gate_proj = self.up_proj = None
        else:
            self.gate_up_proj = serving_linear(config, h, 2 * i, bias=bias, dtype=dtype,
                                               split=Split.COLUMN, role="gate_up_proj",
                                               fused=True)
            self.gate_proj = self.up_proj = None
        self.down_proj = serving_linear(config, i, h, bias=bias, dtype=dtype, split=Split.ROW,
                                        role="down_proj")
        self.activation = config.activation
        self.intermediate_size = i
        self.shards = config.tensor_parallel

    def __call__(self, x: jax.Array,  # [T, hidden]
                 num_rows: jax.Array | None = None) -> jax.Array:  # [] real rows of x
        if isinstance(self.gate_up_proj, PackedGateUp | CodedGateUp):  # activation in the matmul
            return self.down_proj(self.gate_up_proj(x, num_rows), num_rows)
        if self.gate_up_proj is not None:
            # Per shard: [gate_i | up_i] (esurge.models.tensor_parallel).
            gate_up = self.gate_up_proj(x, num_rows).reshape(x.shape[0], self.shards, -1)
            half = self.intermediate_size // self.shards
            gate = gate_up[..., :half].reshape(x.shape[0], -1)
            up = gate_up[..., half:].reshape(x.shape[0], -1)
        elif self.gate_proj is not None and self.up_proj is not None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            raise ValueError("MLP has neither fused nor separate gate/up projections")
        return self.down_proj(_activate(self.activation, gate) * up, num_rows)


class Attention(nnx.Module):
    """Self-attention of one layer over the paged cache (GQA, optional q/k norm)."""

    def __init__(self, config: DecoderConfig, layer: LayerAttention, *, dtype: jnp.dtype):
        h, d = config.hidden_size, config.head_dim
        q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
        bias = config.qkv_bias
        if not config.fused_projections:  # modules before Nones, as in MLP
            self.q_proj: Linear | None = Linear(h, q_out, bias=bias, dtype=dtype)
            self.k_proj: Linear | None = Linear(h, kv_out, bias=bias, dtype=dtype)
            self.v_proj: Linear | None = Linear(h, kv_out, bias=bias, dtype=dtype)
            self.qkv_proj: AnyLinear | None = None
        else:
            self.qkv_proj = serving_linear(config, h, q_out + 2 * kv_out, bias=bias, dtype=dtype,
                                           split=Split.COLUMN, role="qkv_proj", fused=True)
            self.q_proj = self.k_proj = self.v_proj = None
        self.o_proj = serving_linear(config, config.num_heads * d, h, bias=config.o_bias,
                                     dtype=dtype, split=Split.ROW, role="o_proj")
        self.q_norm = make_norm(d, config, dtype) if config.qk_norm else None
        self.k_norm = make_norm(d, config, dtype) if config.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.shards = config.tensor_parallel
        self.scale = float(config.query_scale or d ** -0.5)
        self.softcap = config.attn_softcap
        self.sliding_window = layer.window if layer.kind is AttentionKind.SLIDING else None
        self.chunk_size = layer.window if layer.kind is AttentionKind.CHUNKED else None

    def __call__(
        self,
        x: jax.Array,  # [T, hidden]
        rope: tuple[jax.Array, jax.Array],  # cos, sin: [T, head_dim]
        kv: tuple[jax.Array, jax.Array],  # K, V: [num_pages, page_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
        slot_mapping: jax.Array,  # [T]
        block_pages: int | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:  # [T, hidden], updated (K, V)
        t = x.shape[0]
        q, k, v = self._project(x, metadata.num_tokens)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out, k_cache, v_cache = write_and_attend(
            q, k, v, kv[0], kv[1], slot_mapping, metadata, scale=self.scale,
            sliding_window=self.sliding_window, chunk_size=self.chunk_size,
            softcap=self.softcap, block_pages=block_pages, rope=rope,
        )
        return (self.o_proj(out.reshape(t, self.num_heads * self.head_dim), metadata.num_tokens),
                (k_cache, v_cache))

    def _project(self, x: jax.Array, num_rows: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        if self.qkv_proj is not None:
            # Per shard: [q_i | k_i | v_i] (esurge.models.tensor_parallel).
            t, s = x.shape[0], self.shards
            q_out = self.num_heads * self.head_dim // s
            kv_out = self.num_kv_heads * self.head_dim // s
            qkv = self.qkv_proj(x, num_rows).reshape(t, s, -1)
            q, k = qkv[..., :q_out], qkv[..., q_out:q_out + kv_out]
            return q.reshape(t, -1), k.reshape(t, -1), qkv[..., q_out + kv_out:].reshape(t, -1)
        if self.q_proj is None or self.k_proj is None or self.v_proj is None:
            raise ValueError("Attention has neither fused nor separate q/k/v projections")
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks; Gemma adds norms after each block."""

    def __init__(self, config: DecoderConfig, layer: LayerAttention, *, dtype: jnp.dtype):
        h = config.hidden_size
        self.input_layernorm = make_norm(h, config, dtype)
        self.self_attn = Attention(config, layer, dtype=dtype)
        # Llama: the pre-MLP norm. Gemma: the norm of the attention output.
        self.post_attention_layernorm = make_norm(h, config, dtype)
        self.mlp = MLP(config, dtype=dtype)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(h, config, dtype)
            self.post_feedforward_layernorm = make_norm(h, config, dtype)

    def __call__(
        self,
        x: jax.Array,  # [T, hidden]
        rope: tuple[jax.Array, jax.Array],
        kv: tuple[jax.Array, jax.Array],
        metadata: AttentionMetadata,
        slot_mapping: jax.Array,  # [T]
        block_pages: int | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        attn, kv = self.self_attn(self.input_layernorm(x), rope, kv, metadata, slot_mapping,
                                  block_pages)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x), metadata.num_tokens), kv
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x), metadata.num_tokens)
        return x + self.post_feedforward_layernorm(mlp), kv


def embedding_scale(config: DecoderConfig, dtype: jnp.dtype) -> jax.Array | None:
    """sqrt(hidden) rounded to the weight dtype as transformers' Gemma does, or None."""
    if not config.scale_embeddings:
        return None
    return jnp.asarray(math.sqrt(config.hidden_size), jnp.float32).astype(dtype)
