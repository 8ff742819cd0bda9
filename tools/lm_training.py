"""Training pieces for a small Llama: shape, initialization, dense forward, loss, optimizer.

The model is esurge's own `CausalLM` module tree, so every parameter path
(`model.layers.0.self_attn.q_proj.weight`, ...) is already the Hugging Face
tensor name. Only the attention differs from serving: training runs a plain
dense causal attention over a [batch, seq] block instead of the paged cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from esurge.models.decoder import CausalLM
from esurge.models.decoder_config import DecoderConfig
from esurge.models.families import LLAMA, decoder_config_from_hf
from esurge.models.forward import ModelState, Params
from esurge.models.layers import Attention
from esurge.models.rope import apply_rope, rope_cos_sin

__all__ = [
    "ModelShape", "OptimizerSpec", "build_model", "hf_llama_config", "init_params", "loss_fn",
    "make_optimizer", "make_schedule", "token_losses", "train_logits", "train_step",
]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The size of the Llama to train; `context` is also max_position_embeddings."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 688
    context: int = 512
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "context"):
            _check_positive(name, getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"head_dim ({self.hidden_size // self.num_heads}) must be even")
        if self.vocab_size <= EOS_ID:
            raise ValueError(f"vocab_size must exceed the special ids, got {self.vocab_size}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")


def hf_llama_config(shape: ModelShape) -> Any:
    """The transformers LlamaConfig this shape exports as (bos 1, eos 2, pad 0)."""
    from transformers import LlamaConfig  # heavy import, only needed here

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        hidden_act="silu",
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=["LlamaForCausalLM"],
    )


def build_model(shape: ModelShape) -> tuple[DecoderConfig, nnx.GraphDef[CausalLM], Params]:
    """The decoder config the loader would derive, the graph, and abstract parameters."""
    config = decoder_config_from_hf(hf_llama_config(shape), LLAMA)
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype=jnp.float32))
    graphdef, state = nnx.split(abstract)
    return config, graphdef, nnx.to_pure_dict(state)


def init_params(abstract: Params, num_layers: int, seed: int) -> Params:
    """Norm weights 1, matrices N(0, 0.02); output projections scaled by 1/sqrt(2 layers)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out_std = 0.02 / math.sqrt(2 * num_layers)
    values = []
    for (path, leaf), key in zip(leaves, keys, strict=True):
        name = ".".join(str(getattr(k, "key", k)) for k in path)
        if len(leaf.shape) == 1:
            values.append(jnp.ones(leaf.shape, jnp.float32))
            continue
        std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        values.append(std * jax.random.normal(key, leaf.shape, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, values)


def _dense_attention(
    attn: Attention,
    x: jax.Array,  # [batch, seq, hidden]
    cos: jax.Array,  # [seq, head_dim]
    sin: jax.Array,  # [seq, head_dim]
) -> jax.Array:  # [batch, seq, hidden]
    b, s, _ = x.shape
    q = attn.q_proj(x).reshape(b, s, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).reshape(b, s, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).reshape(b, s, attn.num_kv_heads, attn.head_dim)
    # apply_rope broadcasts its [T, head_dim] tables over the heads axis; here T is seq.
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = jax.nn.dot_product_attention(q, k, v, scale=attn.scale, is_causal=True)
    return attn.o_proj(out.reshape(b, s, attn.num_heads * attn.head_dim))


def train_logits(
    graphdef: nnx.GraphDef[CausalLM], params: Params, ids: jax.Array  # [batch, seq]
) -> jax.Array:  # [batch, seq, vocab] float32
    """Logits of every position, attending causally within each row (Llama layers only)."""
    model = ModelState(graphdef, params).module()
    config = model.config
    seq = ids.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)
    cos, sin = rope_cos_sin(config.layers[0].rope, config.head_dim, positions,
                            jnp.full((seq,), seq, jnp.int32))
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x = x + _dense_attention(layer.self_attn, layer.input_layernorm(x), cos, sin)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = model.model.norm(x)
    return model.compute_logits(hidden.reshape(-1, config.hidden_size)).reshape(
        ids.shape[0], seq, config.vocab_size)


@partial(jax.jit, static_argnames=("graphdef",))
def token_losses(
    params: Params, tokens: jax.Array, *, graphdef: nnx.GraphDef[CausalLM]  # [batch, seq + 1]
) -> jax.Array:  # [batch, seq] float32, nats
    """Cross-entropy of predicting each of tokens[:, 1:] from the tokens before it."""
    logits = train_logits(graphdef, params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def loss_fn(
    params: Params, graphdef: nnx.GraphDef[CausalLM], tokens: jax.Array  # [batch, seq + 1]
) -> jax.Array:  # scalar: mean next-token cross-entropy in nats
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
    logits = train_logits(graphdef, params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """AdamW with linear warmup to peak_lr, then cosine decay to final_lr over total_steps."""

    peak_lr: float = 3e-3
    final_lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    weight_decay: float = 0.1
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("total_steps", self.total_steps)
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.total_steps:
            raise ValueError(f"warmup_steps must be in [0, total_steps={self.total_steps}), "
                             f"got {self.warmup_steps!r}")
        for name in ("peak_lr", "final_lr", "clip_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")


def make_schedule(spec: OptimizerSpec) -> optax.Schedule:
    """Learning rate by step: linear warmup from 0, then cosine down to final_lr."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=spec.peak_lr, warmup_steps=spec.warmup_steps,
        decay_steps=spec.total_steps, end_value=spec.final_lr)


def make_optimizer(spec: OptimizerSpec) -> optax.GradientTransformation:
    """Clipped AdamW on the warmup + cosine schedule; no weight decay on norm weights."""
    schedule = make_schedule(spec)

    def decay_mask(params: Params) -> Params:
        return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)

    return optax.chain(
        optax.clip_by_global_norm(spec.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=spec.weight_decay,
                    mask=decay_mask),
    )


# Module-level and keyed on hashable statics, so repeated runs in one process
# (the tests' interrupted-and-resumed runs) compile once.
@partial(jax.jit, static_argnames=("graphdef", "spec"))
def train_step(
    params: Params,
    opt_state: Any,
    tokens: jax.Array,  # [batch, seq + 1]
    *,
    graphdef: nnx.GraphDef[CausalLM],
    spec: OptimizerSpec,
) -> tuple[Params, Any, jax.Array]:
    """One optimizer step on a batch: (new params, new optimizer state, the batch's loss)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, graphdef, tokens)
    updates, opt_state = make_optimizer(spec).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
