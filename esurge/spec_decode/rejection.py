"""Verification of draft tokens against the target's distributions.

The target scores [last token, d_1 .. d_k] in one forward, giving S = k + 1
distributions per request: row j is the target's distribution for the token
after d_j (row 0: after the last known token). Row j decides draft d_{j+1}.

- Greedy: accept the longest prefix of drafts equal to the target's argmax,
  then emit the target's own token at the first disagreement (or the bonus
  token after all k). The output is token-identical to plain greedy decoding.
- Sampling (speculative rejection sampling): accept d_{j+1} with probability
  min(1, p_j(d) / q_j(d)); at the first rejection emit a sample of the
  residual norm(max(p_j - q_j, 0)); after k acceptances emit a sample of p_k.
  Each emitted token is then distributed exactly as p, whatever q is, as long
  as d_{j+1} was drawn from q_j.

Every random number is supplied by the caller (uniforms, Gumbel noise, the
target's own samples), so the caller decides how they are keyed (per request
seed and output position) and this module stays a pure function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from esurge.models.reductions import first_argmax

__all__ = ["accept_greedy", "rejection_sample"]


def _leading_true(flags: jax.Array) -> jax.Array:  # [R, k] bool -> [R] int32
    return jnp.cumprod(flags.astype(jnp.int32), axis=-1).sum(axis=-1).astype(jnp.int32)


def _valid(drafts: jax.Array, num_drafts: jax.Array) -> jax.Array:  # -> [R, k] bool
    return jnp.arange(drafts.shape[1])[None, :] < num_drafts[:, None]


def accept_greedy(
    target_tokens: jax.Array,  # [R, S] int32: the target's argmax at each row
    drafts: jax.Array,  # [R, k] int32
    num_drafts: jax.Array,  # [R] int32: real drafts per request (<= k)
) -> tuple[jax.Array, jax.Array]:
    """(tokens [R, S], num_out [R]): the first num_out tokens of each row are emitted."""
    k = drafts.shape[1]
    agree = (drafts == target_tokens[:, :k]) & _valid(drafts, num_drafts)
    return target_tokens, _leading_true(agree) + 1


def rejection_sample(
    target_probs: jax.Array,  # [R, S, V] float32: the target's sampling distributions
    draft_probs: jax.Array,  # [R, k, V] float32: the distributions the drafts were drawn from
    drafts: jax.Array,  # [R, k] int32
    num_drafts: jax.Array,  # [R] int32
    uniforms: jax.Array,  # [R, k] float32 in (0, 1): acceptance tests
    recover_noise: jax.Array,  # [R, k, V] float32: Gumbel noise for residual samples
    target_samples: jax.Array,  # [R, S] int32: a sample of target_probs at each row
) -> tuple[jax.Array, jax.Array]:
    """(tokens [R, S], num_out [R]) by speculative rejection sampling (module docstring)."""
    r, k = drafts.shape
    p_k = target_probs[:, :k]
    p_draft = jnp.take_along_axis(p_k, drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    accept = (uniforms * q_draft < p_draft) & _valid(drafts, num_drafts)
    num_accepted = _leading_true(accept)
    residual = jnp.maximum(p_k - draft_probs, 0.0)
    scores = jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0))
                       + recover_noise, -jnp.inf)
    recovered = first_argmax(scores)  # [R, k]
    # p == q leaves no residual; a rejection is then impossible in exact
    # arithmetic, so a plain target sample is the right fallback.
    recovered = jnp.where(residual.max(axis=-1) > 0, recovered, target_samples[:, :k])
    at_draft = jnp.where(_valid(drafts, num_drafts), recovered, target_samples[:, :k])
    last = jnp.concatenate([at_draft, target_samples[:, k:]], axis=1)  # [R, S]
    cols = jnp.arange(k + 1)[None, :]
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((r, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(cols < num_accepted[:, None], padded_drafts, last)
    return tokens.astype(jnp.int32), num_accepted + 1
