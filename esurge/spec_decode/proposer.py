"""The Eagle proposer: k draft tokens per request from the target's hidden states.

After the target step, one jitted call runs:

1. a draft pass over every token row of the step (same bucket, positions and
   page tables as the target): row t pairs the target's feature at position
   t with the token at t + 1 (known prompt/output tokens from the host, or
   this step's emitted tokens from the device), and writes the draft's K/V
   at position t. Rows past a request's accepted run write junk that later
   passes overwrite before anything reads it;
2. the first draft token from the row of each request's last emitted token;
3. k - 1 single-token passes (a `lax.fori_loop`), each feeding back the previous
   draft token and the draft's own hidden state one position further.

A batch with constrained requests stops after step 2 (`propose_first`); the
runner then draws each draft with `masked_draft_step` under the grammar mask
the host computed from the drafts before it.

The draft KV cache is its own pytree over the same page ids as the target's
(indexed by one cache group's page tables), so it is allocated and freed with
the request's pages and needs no bookkeeping of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from esurge.core.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from esurge.models.forward import ShellState
from esurge.models.kv_cache import NULL_PAGE, placed_zeros
from esurge.models.local_shards import host_visible
from esurge.models.paged_attention import AttentionMetadata, write_and_attend
from esurge.models.reductions import first_argmax
from esurge.models.rope import rope_cos_sin
from esurge.spec_decode.config import EagleConfig
from esurge.spec_decode.head import EagleHead, EagleState
from esurge.structured_output.device_mask import allowed_bits

__all__ = ["AttentionWindow", "DraftBatch", "DraftKVCache", "FirstDraft", "draft_group",
           "init_draft_cache", "masked_draft_step", "propose", "propose_first"]


@dataclass(frozen=True, slots=True)
class AttentionWindow:
    """How far back the draft attends: the window of the cache group it reads."""

    sliding_window: int | None = None
    chunk_size: int | None = None


def draft_group(groups: Sequence[Any]) -> tuple[int, AttentionWindow]:
    """The cache group whose page tables the draft reads: a full-attention one if any."""
    for i, group in enumerate(groups):
        if isinstance(group.spec, FullAttentionSpec):
            return i, AttentionWindow()
    spec = groups[0].spec
    if isinstance(spec, SlidingWindowSpec):
        return 0, AttentionWindow(sliding_window=spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return 0, AttentionWindow(chunk_size=spec.attention_chunk_size)
    return 0, AttentionWindow()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftKVCache:
    """Paged keys and values of the draft's layers."""

    keys: tuple[jax.Array, ...]  # num_layers x [num_pages, page_size, kv_heads, head_dim]
    values: tuple[jax.Array, ...]  # num_layers x [num_pages, page_size, kv_heads, head_dim]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.keys[0].shape[1])


def init_draft_cache(config: EagleConfig, num_pages: int, page_size: int,
                     dtype: Any, sharding: jax.sharding.Sharding | None = None) -> DraftKVCache:
    """A zeroed draft cache over num_pages pages (made in place with sharding, if given)."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    layers = range(config.num_layers)
    return DraftKVCache(tuple(placed_zeros(shape, dtype, sharding) for _ in layers),
                        tuple(placed_zeros(shape, dtype, sharding) for _ in layers))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DraftBatch:
    """The arrays of one proposal, aligned with the target step's (T, R) bucket
    (positions and slot_mapping as the target step ran them, on the device).

    slot_mapping and page_tables are the draft's cache group's. next_ids[t] is
    the known token after row t (0 when not known on the host); next_slot[t]
    >= 0 means it is this step's emitted token number next_slot[t] instead.
    first_row[r] is request r's first verification row (its last known token);
    propose[r] says whether r gets drafts; temperature[r] > 0 means r samples.
    """

    positions: Any  # [T] int32
    token_req: Any  # [T] int32
    slot_mapping: Any  # [T] int32
    page_tables: Any  # [R, P] int32
    num_tokens: Any  # [] int32: real token rows
    next_ids: Any  # [T] int32
    next_slot: Any  # [T] int32
    first_row: Any  # [R] int32
    propose: Any  # [R] bool
    temperature: Any  # [R] float32


class _PagedAttend:
    """Attention over the draft's paged cache; collects the updated cache arrays."""

    def __init__(self, cache: DraftKVCache, metadata: AttentionMetadata, slots: jax.Array,
                 config: EagleConfig, window: AttentionWindow) -> None:
        self.keys, self.values = list(cache.keys), list(cache.values)
        self.metadata, self.slots = metadata, slots
        self.scale = config.head_dim ** -0.5
        self.window = window

    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out, kc, vc = write_and_attend(q, k, v, self.keys[layer], self.values[layer],
                                       self.slots, self.metadata, scale=self.scale,
                                       sliding_window=self.window.sliding_window,
                                       chunk_size=self.window.chunk_size)
        self.keys[layer], self.values[layer] = kc, vc
        return out

    def cache(self) -> DraftKVCache:
        return DraftKVCache(tuple(self.keys), tuple(self.values))


def _draw(logits: jax.Array, temperature: jax.Array, noise: jax.Array | None,
          d2t: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array | None]:
    """Draft tokens [R] (target ids) and, when sampling, their distributions [R, V]."""
    # logits: [R, Vd] float32, noise: [R, Vd] Gumbel or None (all greedy)
    greedy = first_argmax(logits)
    if noise is None:
        return greedy + d2t[greedy], None
    sampled = temperature > 0
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    drawn = first_argmax(scaled + noise)
    draft = jnp.where(sampled, drawn, greedy)
    probs_draft = jax.nn.softmax(scaled, axis=-1)
    target_ids = jnp.arange(logits.shape[-1]) + d2t
    probs = jnp.zeros((logits.shape[0], vocab), jnp.float32).at[:, target_ids].set(probs_draft)
    return draft + d2t[draft], probs


def _first_pass(head: EagleHead, target: Any, cache: DraftKVCache, batch: DraftBatch,
                features: jax.Array, out_tokens: jax.Array, num_out: jax.Array,
                window: AttentionWindow) -> tuple[jax.Array, jax.Array, DraftKVCache]:
    """Draft hidden state [R, H] and position [R] at each request's last emitted token."""
    config = head.config
    req = jnp.asarray(batch.token_req)
    slot = jnp.asarray(batch.next_slot)
    take = jnp.clip(jnp.minimum(slot, num_out[req] - 1), 0, out_tokens.shape[1] - 1)
    ids = jnp.where(slot >= 0, out_tokens[req, take], jnp.asarray(batch.next_ids))
    positions = jnp.asarray(batch.positions)
    rope = rope_cos_sin(config.rope, config.head_dim, positions, positions + 1)
    metadata = AttentionMetadata(positions, req, jnp.asarray(batch.page_tables),
                                 jnp.asarray(batch.num_tokens))
    attend = _PagedAttend(cache, metadata, jnp.asarray(batch.slot_mapping), config, window)
    # Packed projections skip the bucket's padding rows (a decode step's few
    # rows sit in a bucket of 16 or more).
    real = jnp.asarray(batch.num_tokens)
    hidden = head.step(head.first_hidden(features, real), head.embed(ids, target), rope, attend,
                       real)
    last = jnp.clip(jnp.asarray(batch.first_row) + num_out - 1, 0, hidden.shape[0] - 1)
    return hidden[last], positions[last], attend.cache()


def _step_slots(page_tables: jax.Array, positions: jax.Array, live: jax.Array,
                page_size: int) -> jax.Array:  # [R, P], [R], [R] -> [R]
    logical = positions // page_size
    in_table = logical < page_tables.shape[1]
    rows = jnp.arange(page_tables.shape[0])
    page = page_tables[rows, jnp.minimum(logical, page_tables.shape[1] - 1)]
    ok = live & in_table
    return jnp.where(ok, page * page_size + positions % page_size, NULL_PAGE * page_size)


def _rows_through_last(live: jax.Array) -> jax.Array:  # [R] bool -> [] int32
    """Rows up to the last live one: the bucket's padding requests come after
    every real one, so packed projections may skip the rest (a lone request in
    a bucket of 4 would otherwise cost each draft step four rows)."""
    return jnp.max(jnp.where(live, jnp.arange(1, live.shape[0] + 1), 0)).astype(jnp.int32)


@dataclass(frozen=True)
class FirstDraft:
    """A draft position's state: its token, distribution, hidden state and position."""

    token: jax.Array  # [R] int32
    probs: jax.Array | None  # [R, V]
    hidden: jax.Array  # [R, H]
    position: jax.Array  # [R] int32, 0 for requests without drafts


jax.tree_util.register_dataclass(FirstDraft, data_fields=["token", "probs", "hidden", "position"],
                                 meta_fields=[])


@partial(jax.jit, static_argnames=("window",), donate_argnums=(1,))
def propose_first(head_state: EagleState, cache: DraftKVCache, target_state: ShellState,
                  batch: DraftBatch, features: jax.Array, out_tokens: jax.Array,
                  num_out: jax.Array, noise: jax.Array | None, *, window: AttentionWindow
                  ) -> tuple[FirstDraft, DraftKVCache]:
    """The pass over the step's token rows and the first draft token (jitted per (T, R));
    `masked_draft_step` continues from it when drafts must follow a grammar. The
    cache is donated."""
    head, target = head_state.module(), target_state.shell()
    hidden, pos, cache = _first_pass(head, target, cache, batch, features, out_tokens,
                                     num_out, window)
    real = _rows_through_last(jnp.asarray(batch.propose))
    token, probs = _draw(head.logits(hidden, target, real), jnp.asarray(batch.temperature),
                         None if noise is None else noise[0], head_state.d2t,
                         head.config.vocab_size)
    pos = jnp.where(jnp.asarray(batch.propose), pos, 0)
    # Replicated: any host may read a proposal alone (DeviceDrafts), no collective.
    return FirstDraft(host_visible(token), probs, hidden, pos), cache


# XLA's CPU backend gathers from a bfloat16 table through a float32 copy of it,
# which in a loop fuses into the gather and converts only the rows taken. Loop-
# invariant code motion hoists that conversion out of the draft loop instead, so
# every call materialized the target's whole embedding table in float32 (108 MiB
# for SmolLM2: a bfloat16 proposal of 2-4 drafts took 27-28 ms instead of
# 0.7-1.1 ms). The loop's body is one small head layer: nothing else worth hoisting.
_DRAFT_LOOP_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


@partial(jax.jit, static_argnames=("max_steps", "window"), donate_argnums=(1,),
         compiler_options=_DRAFT_LOOP_OPTIONS)
def _propose_rest(head_state: EagleState, cache: DraftKVCache, target_state: ShellState,
                  page_tables: jax.Array, live: jax.Array, temperature: jax.Array,
                  first: FirstDraft, noise: jax.Array | None, num_steps: jax.Array, *,
                  max_steps: int, window: AttentionWindow
                  ) -> tuple[jax.Array, jax.Array | None, DraftKVCache]:
    """Draft tokens 2..1 + num_steps, one position per step (jitted per R only).

    num_steps (<= max_steps) is traced: one program serves every draft count,
    running only the passes asked for. Columns past 1 + num_steps of the
    drafts [R, 1 + max_steps] (and of their distributions) are zeros.
    """
    # page_tables: [R, P], live: [R] bool, temperature: [R], noise: [k, R, Vd] or None
    head, target = head_state.module(), target_state.shell()
    config, d2t = head.config, head_state.d2t
    rows = jnp.arange(page_tables.shape[0])
    real = _rows_through_last(live)

    def body(i: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        keys, values, hidden, token, pos, tokens, probs = carry
        pos = jnp.where(live, pos + 1, 0)
        metadata = AttentionMetadata(pos, rows, page_tables, jnp.asarray(rows.shape[0]))
        slots = _step_slots(page_tables, pos, live, cache.page_size)
        attend = _PagedAttend(DraftKVCache(keys, values), metadata, slots, config, window)
        rope = rope_cos_sin(config.rope, config.head_dim, pos, pos + 1)
        hidden = head.step(hidden, head.embed(token, target), rope, attend, real)
        token, step_probs = _draw(head.logits(hidden, target, real), temperature,
                                  None if noise is None else noise[i + 1], d2t,
                                  config.vocab_size)
        tokens = tokens.at[i].set(token)
        if probs is not None and step_probs is not None:
            probs = probs.at[i].set(step_probs)
        new = attend.cache()
        return new.keys, new.values, hidden, token, pos, tokens, probs

    tokens = jnp.zeros((max_steps, rows.shape[0]), jnp.int32)
    probs = (None if first.probs is None
             else jnp.zeros((max_steps, *first.probs.shape), first.probs.dtype))
    init = (cache.keys, cache.values, first.hidden, first.token, first.position, tokens, probs)
    final = lax.fori_loop(0, num_steps, body, init)
    drafts = jnp.concatenate([first.token[:, None], final[5].T], axis=1)
    all_probs = None
    if first.probs is not None and final[6] is not None:
        all_probs = jnp.concatenate([first.probs[:, None], jnp.swapaxes(final[6], 0, 1)],
                                    axis=1)
    return host_visible(drafts), all_probs, DraftKVCache(final[0], final[1])


def _grammar_masked(logits: jax.Array, allowed: jax.Array, d2t: jax.Array) -> jax.Array:
    """Draft-vocabulary logits [R, Vd] with the tokens a packed target-vocabulary
    mask ([R, W] int32) refuses at -inf; a row the mask leaves nothing in the
    draft vocabulary keeps its logits (the host cuts that draft)."""
    target_ids = (jnp.arange(logits.shape[-1]) + d2t).astype(jnp.int32)  # [Vd]
    ok = allowed_bits(allowed, target_ids)  # [R, Vd]
    masked = jnp.where(ok, logits, -jnp.inf)
    return jnp.where(ok.any(axis=-1, keepdims=True), masked, logits)


@partial(jax.jit, static_argnames=("window",), donate_argnums=(1,))
def masked_draft_step(head_state: EagleState, cache: DraftKVCache, target_state: ShellState,
                      page_tables: jax.Array, live: jax.Array, temperature: jax.Array,
                      prev: FirstDraft, noise: jax.Array | None, allowed: jax.Array,
                      advance: jax.Array, *, window: AttentionWindow
                      ) -> tuple[FirstDraft, DraftKVCache]:
    """One draft position under a grammar mask (jitted per R only).

    With advance false it draws the first draft again from `prev`'s hidden
    state (the one `propose_first` left); with advance true it runs the head
    one position past `prev`, as a step of `_propose_rest` does. The host
    computes each mask from the drafts before it, so a constrained request's
    drafts follow its grammar.
    """
    # page_tables: [R, P], live: [R] bool, temperature: [R], noise: [R, Vd] or None,
    # allowed: [R, W] int32 packed over the target vocabulary, advance: [] bool
    head, target = head_state.module(), target_state.shell()
    config = head.config
    rows = jnp.arange(page_tables.shape[0])
    moving = live & advance
    pos = jnp.where(moving, prev.position + 1, prev.position)
    metadata = AttentionMetadata(pos, rows, page_tables, jnp.asarray(rows.shape[0]))
    slots = _step_slots(page_tables, pos, moving, cache.page_size)
    attend = _PagedAttend(cache, metadata, slots, config, window)
    rope = rope_cos_sin(config.rope, config.head_dim, pos, pos + 1)
    real = _rows_through_last(live)
    stepped = head.step(prev.hidden, head.embed(prev.token, target), rope, attend, real)
    hidden = jnp.where(advance, stepped, prev.hidden)
    logits = _grammar_masked(head.logits(hidden, target, real), allowed, head_state.d2t)
    token, probs = _draw(logits, temperature, noise, head_state.d2t, config.vocab_size)
    return FirstDraft(token, probs, hidden, pos), attend.cache()


def propose(
    head_state: EagleState,
    cache: DraftKVCache,
    target_state: ShellState,
    batch: DraftBatch,
    features: jax.Array,  # [T, F] target features (final hidden, or fused aux layers)
    out_tokens: jax.Array,  # [R, S] int32: tokens emitted this step
    num_out: jax.Array,  # [R] int32: how many of them are real
    noise: jax.Array | None,  # [k, R, draft_vocab] Gumbel noise, None when all greedy
    *,
    num_drafts: int,
    max_drafts: int,
    window: AttentionWindow,
) -> tuple[jax.Array, jax.Array | None, DraftKVCache]:
    """(drafts [R, D] target ids, their distributions [R, D, V] or None, updated cache):
    D is 1 for num_drafts 1, else max_drafts (columns past num_drafts are zeros:
    one program serves every count).

    The cache is donated: use only the returned one afterwards.
    """
    first, cache = propose_first(head_state, cache, target_state, batch, features, out_tokens,
                                 num_out, noise, window=window)
    if num_drafts == 1:
        return first.token[:, None], None if first.probs is None else first.probs[:, None], cache
    return _propose_rest(head_state, cache, target_state, batch.page_tables, batch.propose,
                         batch.temperature, first, noise, np.int32(num_drafts - 1),
                         max_steps=max_drafts - 1, window=window)
