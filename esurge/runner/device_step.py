"""The jitted device side of one step: feed back async tokens, run the model."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from esurge.models.batch import ForwardBatch
from esurge.models.forward import ModelState, forward
from esurge.models.kv_cache import KVCache

__all__ = ["model_step", "pad_tokens", "prompt_logprobs_step"]


@partial(jax.jit, donate_argnums=(1,))
def model_step(
    model_state: ModelState,
    kv_cache: KVCache,
    batch: ForwardBatch,
    prev_tokens: jax.Array,  # [max_rows] int32: last step's sampled tokens
    prev_index: jax.Array,  # [T] int32: >= 0 where the input id comes from prev_tokens
) -> tuple[jax.Array, jax.Array, KVCache]:
    """(logits [L, V], final hidden [T, H], updated cache)."""
    fed_back = prev_tokens[jnp.maximum(prev_index, 0)]
    ids = jnp.where(prev_index >= 0, fed_back, batch.input_ids)
    logits, hidden, kv_cache = forward(model_state, kv_cache,
                                       dataclasses.replace(batch, input_ids=ids))
    return logits, hidden, kv_cache


@partial(jax.jit, static_argnums=(1,))
def pad_tokens(tokens: jax.Array, size: int) -> jax.Array:
    """[R] -> [size] int32, zero padded (fixed-shape feedback buffer)."""
    return jnp.zeros(size, jnp.int32).at[: tokens.shape[0]].set(tokens)


@partial(jax.jit, static_argnums=(4,))
def prompt_logprobs_step(
    model_state: ModelState,
    hidden: jax.Array,  # [T, H] final hidden states of the step
    rows: jax.Array,  # [T] int32: token rows to score
    targets: jax.Array,  # [T] int32: the prompt token each row predicts
    top_n: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of prompt tokens: (ids [T, 1 + n], logprobs [T, 1 + n], ranks [T])."""
    logits = model_state.module().compute_logits(hidden[rows])
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, targets[:, None], axis=-1)
    ranks = (logp > chosen).sum(axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(logp, top_n)
    ids = jnp.concatenate([targets[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return ids, jnp.concatenate([chosen, top_lp], axis=-1), ranks
