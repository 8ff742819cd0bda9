"""The jitted device side of one step: feed back async tokens, run the model."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from esurge.models.batch import ForwardBatch
from esurge.models.forward import ModelState, ShellState, forward, logits_rows
from esurge.models.kv_cache import KVCache
from esurge.models.local_shards import host_visible
from esurge.runner.packed_inputs import InputLayout
from esurge.runner.real_rows import argmax_rows, map_real_rows, sample_rows
from esurge.runner.sampler import (
    SamplerOutput,
    SamplerVariant,
    SamplingTensors,
    apply_grammar,
    token_logprobs,
)

__all__ = ["FollowInputs", "decode_burst_step", "follow_in_flight", "follow_shift", "model_step",
           "model_step_features", "pad_tokens",
           "prompt_logprobs_step", "sample_step", "sampled_logprobs_step"]


@partial(jax.jit, donate_argnums=(1,), static_argnames=("layout",))
def model_step(
    model_state: ModelState,
    kv_cache: KVCache,
    inputs: jax.Array,  # [layout.size] int32: the step's arrays, packed (pack_inputs)
    prev_tokens: jax.Array,  # [max_rows] int32: last step's sampled tokens
    layout: InputLayout,
) -> tuple[jax.Array, jax.Array, KVCache, jax.Array]:
    """(logits [L, V], final hidden [T, H], updated cache, greedy tokens).

    inputs holds the ForwardBatch arrays and prev_index ([T]: >= 0 where the
    input id comes from prev_tokens), one transfer for the whole step. The
    greedy tokens (argmax per logits row, as `sample` picks them for the plain
    greedy variant) come padded to prev_tokens' shape, ready to feed the next
    step: a plain greedy batch then needs no separate sampling call.
    """
    batch, prev_index, _ = layout.unpack(inputs)
    ids = _fed_back_ids(batch, prev_index, prev_tokens)
    logits, hidden, kv_cache = forward(model_state, kv_cache,
                                       dataclasses.replace(batch, input_ids=ids))
    greedy = argmax_rows(logits, logits_rows(jnp.asarray(batch.logits_indices)))
    return logits, hidden, kv_cache, host_visible(pad_tokens(greedy, prev_tokens.shape[0]))


def _fed_back_ids(batch: ForwardBatch, prev_index: jax.Array,  # [T]
                  prev_tokens: jax.Array,  # [max_rows]
                  ) -> jax.Array:
    """[T] input ids with the in-flight ones read from the previous step's tokens."""
    return jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], batch.input_ids)


@partial(jax.jit, donate_argnums=(1,), static_argnames=("layout", "variant"))
def decode_burst_step(
    model_state: ModelState,
    kv_cache: KVCache,
    inputs: jax.Array,  # [layout.size] int32: a burst's arrays, packed (pack_inputs)
    prev_tokens: jax.Array,  # [max_rows] int32: last step's sampled tokens
    tensors: SamplingTensors | None,  # the first iteration's; None when all greedy
    layout: InputLayout,
    variant: SamplerVariant,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """(tokens [K, R], updated cache, the last iteration's tokens padded to
    [max_rows] for the next step) of a K-iteration decode burst.

    Iteration j runs every request one token on from iteration j - 1, whose
    tokens are its inputs, with the keys and values going to the j-th burst
    slot mapping, and samples at output positions tensors.positions + j: the
    draw `sample` makes for that position in a plain step. The variant must be
    neither dense nor logprobs. Rows are one token per request (R = logits rows).
    """
    if variant.dense or variant.logprobs:
        raise ValueError(f"a decode burst cannot run the sampler variant {variant}")
    if not variant.all_greedy and tensors is None:
        raise ValueError("a sampled decode burst needs SamplingTensors")
    batch, prev_index, later_slots = layout.unpack(inputs)
    if later_slots is None:
        raise ValueError("decode_burst_step needs a layout packed with burst slots")
    real = batch.seq_lens > 0  # [R] padding requests keep seq_len 0
    num_rows = logits_rows(jnp.asarray(batch.logits_indices))
    slot_maps = jnp.concatenate([batch.slot_mapping[None], later_slots])  # [K, G, T]

    def iteration(carry: tuple[KVCache, jax.Array], j: jax.Array
                  ) -> tuple[tuple[KVCache, jax.Array], jax.Array]:
        kv, ids = carry
        step = dataclasses.replace(batch, input_ids=ids, positions=batch.positions + j,
                                   slot_mapping=slot_maps[j],
                                   seq_lens=jnp.where(real, batch.seq_lens + j, 0))
        logits, _, kv = forward(model_state, kv, step)
        if tensors is None:
            tokens = argmax_rows(logits, num_rows)
        else:
            moved = dataclasses.replace(tensors, positions=tensors.positions + j)
            tokens = sample_rows(logits, moved, num_rows, variant).token_ids
        # Request i owns token row i (one token each), so its next input sits there.
        return (kv, pad_tokens(tokens[:ids.shape[0]], ids.shape[0])), tokens

    first_ids = _fed_back_ids(batch, prev_index, prev_tokens)
    (kv_cache, _), tokens = jax.lax.scan(iteration, (kv_cache, first_ids),
                                         jnp.arange(layout.num_steps))
    last = pad_tokens(tokens[-1], prev_tokens.shape[0])
    return host_visible(tokens), kv_cache, host_visible(last)


@struct.dataclass
class FollowInputs:
    """How a speculative step dispatched before the one in flight was read
    follows it: the host built its positions as if every draft in flight were
    accepted, and left the ids of that step's last tokens out."""

    # [T] int32: >= 0: the token row's id is that in-flight row's last token.
    index: jax.Array | np.ndarray
    src: jax.Array | np.ndarray  # [R] int32: each request's row in the step in flight, -1: none
    last_tokens: jax.Array  # [M] int32: that step's last emitted token per row
    rejected: jax.Array  # [M] int32: its rejected drafts per row


def follow_shift(src: jax.Array | np.ndarray,  # [R] int32 (FollowInputs.src)
                 rejected: jax.Array,  # [M] int32 (FollowInputs.rejected)
                 ) -> jax.Array:
    """[R] int32: how far each request moves back (0 where it follows no step)."""
    src = jnp.asarray(src)
    return jnp.where(src >= 0, -rejected[jnp.maximum(src, 0)], 0)


def follow_in_flight(batch: ForwardBatch, follow: FollowInputs, page_size: int) -> ForwardBatch:
    """The batch with every request of the step in flight moved back over its
    rejected drafts (positions, cache slots, lengths) and fed that step's last
    tokens: nothing moves where src is -1 and index is -1 everywhere."""
    shift_req = follow_shift(follow.src, follow.rejected)
    token_req = jnp.asarray(batch.token_req)
    real = jnp.arange(token_req.shape[0]) < jnp.asarray(batch.query_start_loc)[-1]
    shift = jnp.where(real, shift_req[token_req], 0)  # [T]
    positions = jnp.asarray(batch.positions) + shift
    tables = jnp.asarray(batch.page_tables)  # [G, R, P]
    moved = tables[:, token_req, positions // page_size] * page_size + positions % page_size
    ids = jnp.where(follow.index >= 0, follow.last_tokens[jnp.maximum(follow.index, 0)],
                    batch.input_ids)
    return dataclasses.replace(
        batch, input_ids=ids, positions=positions, seq_lens=jnp.asarray(batch.seq_lens) + shift_req,
        slot_mapping=jnp.where(shift != 0, moved, jnp.asarray(batch.slot_mapping)))


@partial(jax.jit, donate_argnums=(1,),
         static_argnames=("feature_layers", "page_size", "slot_group"))
def model_step_features(
    model_state: ModelState,
    kv_cache: KVCache,
    batch: ForwardBatch,
    feature_layers: tuple[int, ...],
    draft_buffer: jax.Array | None = None,  # [M, k] int32: the head's proposals, by slot
    draft_feed: jax.Array | None = None,  # [T] int32: index into it flattened, -1: input_ids
    follow: FollowInputs | None = None,
    page_size: int = 1,
    slot_group: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array, KVCache, tuple[jax.Array, jax.Array]]:
    """(logits [L, V], final hidden [T, H], draft features [T, F], updated cache,
    (positions [T], cache slots [T] of slot_group) as run).

    feature_layers () makes the features the final hidden states (EAGLE-1);
    otherwise they are the outputs of those layers concatenated ([T, n * H],
    EAGLE-3). The final hidden state then comes from the last layer's output
    through the model's final norm, as forward computes it. Token rows with
    a draft_feed index take their id from the draft buffer: drafts the
    previous step proposed are fed from the device, not the host. `follow`
    moves the requests of a speculative step still in flight to where its
    verification left them (follow_in_flight); the positions and slots as run
    are where the head's proposal writes (the draft's cache group, slot_group).
    """
    if draft_buffer is not None and draft_feed is not None:
        ids = jnp.where(draft_feed >= 0, draft_buffer.reshape(-1)[jnp.maximum(draft_feed, 0)],
                        batch.input_ids)
        batch = dataclasses.replace(batch, input_ids=ids)
    if follow is not None:
        batch = follow_in_flight(batch, follow, page_size)
    as_run = (jnp.asarray(batch.positions), jnp.asarray(batch.slot_mapping)[slot_group])
    if not feature_layers:
        logits, hidden, kv_cache = forward(model_state, kv_cache, batch)
        return logits, hidden, hidden, kv_cache, as_run
    shell = model_state.shell()
    last = shell.config.num_layers - 1
    wanted = tuple(sorted({*feature_layers, last}))
    logits, aux, kv_cache = forward(model_state, kv_cache, batch, aux_hidden_layer_ids=wanted)
    hidden = shell.model.norm(aux[wanted.index(last)])
    features = jnp.concatenate([aux[wanted.index(i)] for i in feature_layers], axis=-1)
    return logits, hidden, features, kv_cache, as_run


def pad_tokens(tokens: jax.Array, size: int) -> jax.Array:
    """[R] -> [size] int32, zero padded (fixed-shape feedback buffer)."""
    return jnp.zeros(size, jnp.int32).at[: tokens.shape[0]].set(tokens)


@partial(jax.jit, static_argnames=("variant", "feedback_size"))
def sample_step(
    logits: jax.Array,  # [L >= R, V]: a model step's, padded to its request floor
    tensors: SamplingTensors,  # [R] rows
    num_rows: jax.Array,  # [] int32: the step's real rows (the rest is padding)
    variant: SamplerVariant,
    feedback_size: int,
) -> tuple[SamplerOutput, jax.Array]:
    """The sampled tokens of the first R logits rows (0 past num_rows), and the
    same padded to the fixed-shape buffer [feedback_size] the next model step
    reads (one dispatch, not two)."""
    rows = tensors.temperature.shape[0]
    out = host_visible(sample_rows(logits[:rows], tensors, num_rows, variant))
    return out, host_visible(pad_tokens(out.token_ids, feedback_size))


@jax.jit
def sampled_logprobs_step(
    logits: jax.Array,  # [L >= R, V] the model step's; the first R rows are sampled
    allowed: jax.Array | None,  # [R, ceil(V / 32)] int32 packed grammar masks, as sampled
    tokens: jax.Array,  # [R] int32 the sampled tokens
    num_rows: jax.Array,  # [] int32: the step's real rows (the rest is padding)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ids [R, 1 + n], logprobs [R, 1 + n], ranks [R]) of the sampled tokens: what a
    logprobs sampler variant returns, as a program of its own so that the sampler
    variants need not be compiled twice (with and without logprobs)."""
    raw = logits[:tokens.shape[0]].astype(jnp.float32)
    if allowed is not None:
        raw = apply_grammar(raw, allowed)
    return host_visible(map_real_rows(token_logprobs, num_rows, raw, tokens))


@partial(jax.jit, static_argnums=(4,))
def prompt_logprobs_step(
    shell_state: ShellState,
    hidden: jax.Array,  # [T, H] final hidden states of the step
    rows: jax.Array,  # [C] int32: token rows to score
    targets: jax.Array,  # [C] int32: the prompt token each row predicts
    top_n: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of prompt tokens: (ids [C, 1 + n], logprobs [C, 1 + n], ranks [C])."""
    return host_visible(token_logprobs(shell_state.shell().compute_logits(hidden[rows]),
                                       targets, top_n))
