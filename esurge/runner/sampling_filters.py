"""min-p, top-k and top-p cuts of a batch of scaled logits, without sorting the vocabulary.

top-k and top-p are defined on each row's logits in descending order. A full
sort says it directly, but XLA's CPU sort is slow: [64, 49152] rows (SmolLM2's
vocabulary at 64 running requests) took 0.58 s, more than ten decode steps
of the model, on every sampled step. The cut only ever reaches into the head
of the order, so each row is first tried on its 256 largest logits
(`lax.top_k`, about 11 ms for the same batch): that settles a row when its
top-k lies among them, or when it has no top-k and its nucleus ends among
them (the full row's sum gives the normaliser). Rows left unsettled (a
nucleus wider than the candidates: top-p near 1 over a flat distribution, or
a top-k beyond them) are tried on 4,096, and only rows still unsettled take
the full sort; each tier runs only in a step that has a row needing it.
Rows that ask for neither cut are left as they are, and a batch where no row
asks skips it (min-p likewise).

Each row's result is the same whichever path its neighbours send the batch
down: a settled row always keeps its candidate result, so a seeded request
samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from esurge.runner.sampler import SamplingTensors

__all__ = ["CANDIDATES", "apply_filters", "sorted_cut"]

_NEG_INF = -jnp.inf
# Logits per row the cuts are tried on, a wider set for rows the first leaves
# unsettled (measured on a 2-core EPYC, [64, 49152] rows: lax.top_k 11 ms at
# 256, 29 ms at 1024, 91 ms at 4096; the full sort 581 ms).
CANDIDATES = (256, 4096)


def apply_filters(logits: jax.Array,  # [R, V], already divided by temperature
                  t: SamplingTensors) -> jax.Array:
    """min-p, then top-k and top-p (in vLLM's order); cut tokens become -inf."""
    logits = jax.lax.cond(jnp.any(t.min_p > 0.0), _min_p_cut, lambda x, _t: x, logits, t)
    cut = (t.top_k < logits.shape[-1]) | (t.top_p < 1.0)
    return jax.lax.cond(jnp.any(cut), _cut_rows, lambda x, _t, _c: x, logits, t, cut)


def _min_p_cut(logits: jax.Array,  # [R, V]
               t: SamplingTensors) -> jax.Array:
    probs = jax.nn.softmax(logits, axis=-1)
    max_prob = probs.max(axis=-1, keepdims=True)
    return jnp.where(probs < t.min_p[:, None] * max_prob, _NEG_INF, logits)


def _cut_rows(logits: jax.Array,  # [R, V]
              t: SamplingTensors, cut: jax.Array,  # [R] bool: the row asks for a cut
              ) -> jax.Array:
    return jnp.where(cut[:, None], _cut_from(0, logits, t, ~cut), logits)


def _cut_from(tier: int, logits: jax.Array,  # [R, V]
              t: SamplingTensors, done: jax.Array,  # [R] bool: rows that need nothing here
              ) -> jax.Array:
    """The cut by the candidates of `tier`, the rows they leave unsettled by the
    next tier's (the full sort after the last), each only when some row needs it.

    A tier as wide as the vocabulary is the full sort itself (the same cut,
    bit for bit): the sort stands in for it, one program part fewer to
    compile for every sampled variant (about 0.2 s each with a 4,096-token
    vocabulary)."""
    if tier == len(CANDIDATES) or CANDIDATES[tier] >= logits.shape[-1]:
        return sorted_cut(logits, t)
    filtered, settled = _candidate_cut(logits, t, CANDIDATES[tier])
    settled = settled | done
    return jax.lax.cond(
        jnp.all(settled), lambda: filtered,
        lambda: jnp.where(settled[:, None], filtered, _cut_from(tier + 1, logits, t, settled)))


def _candidate_cut(logits: jax.Array,  # [R, V]
                   t: SamplingTensors, candidates: int) -> tuple[jax.Array, jax.Array]:
    """(the cut logits, [R] bool: rows whose cut the top `candidates` settle)."""
    vocab = logits.shape[-1]
    count = min(vocab, candidates)
    top_k = jnp.asarray(t.top_k)
    top = jax.lax.top_k(logits, count)[0]  # [R, count], descending
    top = jnp.where(jnp.arange(count)[None, :] < top_k[:, None], top, _NEG_INF)
    within = top_k <= count  # every top-k survivor is a candidate
    peak = top[:, :1]  # the row's largest logit (min-p never cuts it)
    weights = jnp.exp(top - peak)
    # Without a top-k the normaliser is the whole row's; a top-k beyond the
    # candidates needs ranks they do not have (such rows are not settled).
    total = jnp.where(within, weights.sum(axis=-1), jnp.exp(logits - peak).sum(axis=-1))
    probs = weights / total[:, None]
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < t.top_p[:, None]) & (top > _NEG_INF)
    settled = within | ((top_k >= vocab) & ~keep[:, -1])
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    threshold = jnp.take_along_axis(top, (num_keep - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, _NEG_INF, logits), settled


def sorted_cut(logits: jax.Array,  # [R, V], min-p applied
               t: SamplingTensors) -> jax.Array:
    """top-k and top-p from a full sort of each row: the reference the candidates match."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    sorted_desc = jnp.where(ranks < t.top_k[:, None], sorted_desc, _NEG_INF)
    sorted_probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = (mass_before < t.top_p[:, None]) & (sorted_desc > _NEG_INF)
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, _NEG_INF, logits)
