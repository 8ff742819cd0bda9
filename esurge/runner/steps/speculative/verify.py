"""On-device verification of draft tokens, in the target step.

The logits come in 1 + k rows per request (`StepInputs` layout). Each row is
processed exactly as the plain sampler would process the logits of that
output position (penalties and masks, temperature, min-p, top-k, top-p), so
the target distributions being verified are the ones plain sampling draws
from. Greedy rows accept the longest agreeing prefix; sampled rows go
through `esurge.spec_decode.rejection.rejection_sample`.

Randomness is counter-based, keyed by (request seed, output position) and a
stream salt: the target's own sample at a position uses the plain sampler's
noise (so a request with no drafts samples exactly as without speculation),
acceptance tests, residual samples and the draft's own sampling each use
their own stream, so no random number is ever used twice.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from esurge.models.local_shards import host_visible
from esurge.models.reductions import first_argmax
from esurge.outputs import TokenLogprobs
from esurge.runner.device_step import follow_shift, pad_tokens
from esurge.runner.host_read import to_host
from esurge.runner.real_rows import argmax_rows
from esurge.runner.sampler import (
    SamplerVariant,
    SamplingTensors,
    apply_filters,
    gumbel_noise,
    process,
    token_logprobs,
    uniform_noise,
)
from esurge.runner.step_inputs import StepInputs
from esurge.spec_decode.rejection import accept_greedy, rejection_sample

__all__ = ["SpecSamplerOutput", "emitted_logprobs", "store_draft_probs", "store_drafts",
           "verify", "verify_jit"]

_ACCEPT_SALT = 0xA5C3E1F7
_RECOVER_SALT = 0x5B2D94C1
_DRAFT_SALT = 0xC8E1B3D5


@struct.dataclass
class SpecSamplerOutput:
    """Emitted tokens per request and what the proposer and logprobs need."""

    token_ids: jax.Array  # [R, S] int32: the first num_out of each row are emitted
    num_out: jax.Array  # [R] int32
    # Padded to the runner's rows: each request's last emitted token and its
    # rejected drafts, for a step dispatched before this one is read (FollowInputs).
    last_tokens: jax.Array | None = None  # [max_rows] int32
    rejected: jax.Array | None = None  # [max_rows] int32
    draft_noise: jax.Array | None = None  # [k, R, draft_vocab] Gumbel noise for drafting
    logprob_token_ids: jax.Array | None = None  # [R, S, 1 + MAX_LOGPROBS] int32
    logprobs: jax.Array | None = None  # [R, S, 1 + MAX_LOGPROBS] float32
    ranks: jax.Array | None = None  # [R, S] int32


def _salted(seeds: jax.Array | np.ndarray, salt: int) -> jax.Array:  # [R, 2] uint32
    seeds = jnp.asarray(seeds, jnp.uint32)
    return seeds.at[:, 1].set(seeds[:, 1] ^ jnp.uint32(salt))


def _per_row(tensors: SamplingTensors, s: int) -> SamplingTensors:
    """Each request's tensors repeated for its s rows; positions advance by row.
    The grammar masks already come one per row."""
    positions = jnp.asarray(tensors.positions)[:, None] + jnp.arange(s)[None, :]
    rows = jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x), s, axis=0),
                        dataclasses.replace(tensors, allowed=None))
    return rows.replace(positions=positions.reshape(-1), allowed=tensors.allowed)


def _draft_noise(tensors: SamplingTensors, k: int, draft_vocab: int) -> jax.Array:
    """[k, R, draft_vocab]: noise for draft step i keyed by the step's first output position."""
    return jnp.stack([gumbel_noise(_salted(tensors.seeds, _DRAFT_SALT + i), tensors.positions,
                                   draft_vocab) for i in range(k)])


def _sampled(processed: jax.Array, rows: SamplingTensors, greedy: jax.Array,
             drafts: jax.Array, num_drafts: jax.Array, draft_probs: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling for every request (greedy rows use their argmax as the sample)."""
    r, k = drafts.shape
    s, vocab = k + 1, processed.shape[-1]
    is_greedy = rows.temperature <= 0.0
    scaled = apply_filters(processed / jnp.where(is_greedy, 1.0, rows.temperature)[:, None], rows)
    own = first_argmax(scaled + gumbel_noise(rows.seeds, rows.positions, vocab))
    own = jnp.where(is_greedy, greedy, own.astype(jnp.int32)).reshape(r, s)
    probs = jax.nn.softmax(scaled, axis=-1).reshape(r, s, vocab)
    head_rows = jax.tree.map(lambda x: x.reshape(r, s, *x.shape[1:])[:, :k].reshape(
        r * k, *x.shape[1:]), rows)
    uniforms = uniform_noise(_salted(head_rows.seeds, _ACCEPT_SALT), head_rows.positions, 1)
    recover = gumbel_noise(_salted(head_rows.seeds, _RECOVER_SALT), head_rows.positions, vocab)
    return rejection_sample(probs, draft_probs, drafts, num_drafts, uniforms.reshape(r, k),
                            recover.reshape(r, k, vocab), own)


def verify(
    logits: jax.Array,  # [R * S, V]: S = 1 + k rows per request
    tensors: SamplingTensors,  # per request, padded to R; allowed: [R * S, W], per row
    drafts: jax.Array,  # [R, k] int32
    num_drafts: jax.Array,  # [R] int32
    draft_probs: jax.Array,  # [M, k, V] float32: stored draft distributions
    prob_slots: jax.Array,  # [R] int32: each request's slot in draft_probs
    draft_buffer: jax.Array,  # [M, k] int32: drafts the head proposed, by slot
    draft_slots: jax.Array,  # [R] int32: a request's drafts' slot there, -1: in drafts
    variant: SamplerVariant,
    draft_vocab: int,
    num_rows: jax.Array,  # [] int32: logits rows of real requests (the first ones)
    follow_src: jax.Array,  # [R] int32: FollowInputs.src of the target step
    follow_rejected: jax.Array,  # [M] int32: FollowInputs.rejected
    feedback_size: int,
) -> SpecSamplerOutput:
    """Verify every request's drafts; see the module docstring. The greedy pick
    skips the padding requests' rows where the backend loops over rows
    (esurge.runner.real_rows): a lone request in a bucket of 4 has 15 of 20.
    A request's drafts come from draft_buffer where draft_slots names a slot
    (the previous step's proposals, never read to the host). The follow
    arrays move the output positions (which key the random draws) of requests
    placed as if a step still in flight accepted every draft, as the target moved
    theirs (device_step.follow_in_flight). feedback_size pads last_tokens and
    rejected to the runner's rows."""
    drafts = jnp.where((draft_slots >= 0)[:, None],
                       draft_buffer[jnp.maximum(draft_slots, 0)], drafts)
    moved = jnp.asarray(tensors.positions) + follow_shift(follow_src, follow_rejected)
    tensors = dataclasses.replace(tensors, positions=moved)
    r, k = drafts.shape
    s = k + 1
    rows = _per_row(tensors, s)
    raw, processed = process(logits.astype(jnp.float32), rows, variant)
    greedy = argmax_rows(processed, num_rows)
    tokens, num_out = accept_greedy(greedy.reshape(r, s), drafts, num_drafts)
    noise = None
    if not variant.all_greedy:
        stored = draft_probs[prob_slots]
        s_tokens, s_num = _sampled(processed, rows, greedy, drafts, num_drafts, stored)
        sampled_req = jnp.asarray(tensors.temperature) > 0.0
        tokens = jnp.where(sampled_req[:, None], s_tokens, tokens)
        num_out = jnp.where(sampled_req, s_num, num_out)
        noise = _draft_noise(tensors, k, draft_vocab)
    last = jnp.take_along_axis(tokens, jnp.maximum(num_out - 1, 0)[:, None], axis=1)[:, 0]
    out = SpecSamplerOutput(token_ids=tokens, num_out=num_out, draft_noise=noise,
                            last_tokens=pad_tokens(last, feedback_size),
                            rejected=pad_tokens(num_drafts - num_out + 1, feedback_size))
    if not variant.logprobs:
        return host_visible(out)
    ids, lps, ranks = token_logprobs(raw, tokens.reshape(-1))
    return host_visible(dataclasses.replace(
        out, logprob_token_ids=ids.reshape(r, s, -1), logprobs=lps.reshape(r, s, -1),
        ranks=ranks.reshape(r, s)))


verify_jit = jax.jit(verify, static_argnames=("variant", "draft_vocab", "feedback_size"))


@partial(jax.jit, donate_argnums=(0,))
def store_drafts(
    buffer: jax.Array,  # [M, k] int32
    slots: jax.Array,  # [R] int32
    drafts: jax.Array,  # [R, d] int32: d <= k drafts per request
) -> jax.Array:
    """Keep each request's drafts on the device for the step that verifies them."""
    return buffer.at[slots, :drafts.shape[1]].set(drafts)


@partial(jax.jit, donate_argnums=(0,))
def store_draft_probs(
    buffer: jax.Array,  # [M, k, V]
    slots: jax.Array,  # [R] int32
    probs: jax.Array,  # [R, d, V]: d <= k drafts per request
) -> jax.Array:
    """Keep each request's draft distributions until its drafts are verified."""
    return buffer.at[slots, :probs.shape[1]].set(probs)


def emitted_logprobs(inputs: StepInputs, verified: SpecSamplerOutput,
                     num_logprobs: np.ndarray  # [R] per scheduled request, read at dispatch
                     ) -> list[list[TokenLogprobs] | None] | None:
    """Per request, one TokenLogprobs per emitted token (None where not asked)."""
    if verified.logprobs is None or verified.logprob_token_ids is None or (
            verified.ranks is None):
        return None
    ids, lps = to_host(verified.logprob_token_ids), to_host(verified.logprobs)
    ranks, num_out = to_host(verified.ranks), to_host(verified.num_out)
    out: list[list[TokenLogprobs] | None] = []
    for i in range(len(inputs.req_ids)):
        n = int(num_logprobs[i])
        if n < 0 or not inputs.samples[i]:
            out.append(None)
            continue
        out.append([TokenLogprobs.from_row(ids[i, j], lps[i, j], ranks[i, j], n)
                    for j in range(int(num_out[i]))])
    return out
