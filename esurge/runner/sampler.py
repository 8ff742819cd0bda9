"""On-device sampling over a batch of logits rows.

One pure function, jitted per (row bucket, `SamplerVariant`). The variant is
static and derived from the batch, so a batch of greedy requests pays for an
argmax and nothing else, and options nobody asked for cost nothing.

Processing order (as in vLLM): a grammar's token mask (structured output)
first, on the raw logits, so logprobs report the masked distribution; then
penalties and the dense additive mask (logit bias, allowed tokens, bad
words, min_tokens); greedy rows
take the argmax of that; sampled rows divide by temperature, apply min-p,
top-k and top-p, and draw with the Gumbel-max trick from a key derived only
from the request's seed and output position, so a seeded request samples the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from esurge.models.reductions import first_argmax
from esurge.runner.sampling_filters import apply_filters
from esurge.sampling_params import MAX_LOGPROBS
from esurge.structured_output.device_mask import allowed_bits

__all__ = [
    "MAX_LOGPROBS", "SamplerOutput", "SamplerVariant", "SamplingTensors", "apply_dense",
    "apply_filters", "apply_grammar", "gumbel_noise", "process", "sample", "token_logprobs",
    "uniform_noise",
]

_NEG_INF = -jnp.inf
# Host builds these with numpy; inside jit they are jax arrays.
Array = jax.Array | np.ndarray


@dataclass(frozen=True, slots=True)
class SamplerVariant:
    """Static features a batch needs; each distinct value is one compiled program
    (a plain sampled step compiles logprobs apart, device_step.sampled_logprobs_step)."""

    all_greedy: bool = True
    dense: bool = False  # penalties or an additive mask are present
    logprobs: bool = False  # some row asked for logprobs


@struct.dataclass
class SamplingTensors:
    """Per-row sampling inputs, padded to the row bucket.

    top_k holds the vocabulary size for rows without a top-k cut. Dense
    fields are None unless the variant is dense.
    """

    temperature: Array  # [R] float32, 0 for greedy rows
    top_k: Array  # [R] int32
    top_p: Array  # [R] float32
    min_p: Array  # [R] float32
    seeds: Array  # [R, 2] uint32, low and high words of the request seed
    positions: Array  # [R] int32, index of the token being sampled in the output
    additive: Array | None = None  # [R, V] float32: bias, -inf for banned tokens
    output_counts: Array | None = None  # [R, V] int32: occurrences in the output
    seen_mask: Array | None = None  # [R, V] bool: in prompt or output
    presence_penalty: Array | None = None  # [R] float32
    frequency_penalty: Array | None = None  # [R] float32
    repetition_penalty: Array | None = None  # [R] float32
    # Packed grammar masks (bit t of word t // 32: token t allowed); every bit
    # set for unconstrained rows. Always given to sample_step (one program
    # per variant whether or not a row is constrained), never to a burst.
    allowed: Array | None = None  # [R, ceil(V / 32)] int32


@struct.dataclass
class SamplerOutput:
    """Sampled tokens and, in a logprobs variant, their log-probabilities."""

    token_ids: jax.Array  # [R] int32
    logprob_token_ids: jax.Array | None = None  # [R, 1 + MAX_LOGPROBS] int32
    logprobs: jax.Array | None = None  # [R, 1 + MAX_LOGPROBS] float32
    ranks: jax.Array | None = None  # [R] int32, 1-based rank of the sampled token


def apply_dense(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Penalties, then the additive bias/mask.  logits: [R, V]."""
    if (t.additive is None or t.output_counts is None or t.seen_mask is None
            or t.presence_penalty is None or t.frequency_penalty is None
            or t.repetition_penalty is None):
        raise ValueError("a dense SamplerVariant needs every dense field of SamplingTensors")
    rep = t.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(t.seen_mask, penalised, logits)
    counts = t.output_counts.astype(logits.dtype)
    logits = logits - t.frequency_penalty[:, None] * counts
    logits = logits - t.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)
    return logits + t.additive


def apply_grammar(logits: jax.Array,  # [R, V]
                  allowed: Array,  # [R, ceil(V / 32)] int32, packed
                  ) -> jax.Array:
    """Disallowed tokens to -inf."""
    cols = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    return jnp.where(allowed_bits(allowed, cols), logits, _NEG_INF)


def process(raw: jax.Array,  # [R, V] float32
            tensors: SamplingTensors, variant: SamplerVariant) -> tuple[jax.Array, jax.Array]:
    """(masked raw logits, processed logits): the grammar mask, then penalties and
    the dense mask. A row the dense mask would leave without any token (a
    grammar and an allow-list that do not meet) keeps the grammar's choice."""
    if tensors.allowed is not None:
        raw = apply_grammar(raw, tensors.allowed)
    if not variant.dense:
        return raw, raw
    processed = apply_dense(raw, tensors)
    if tensors.allowed is not None:
        empty = jnp.all(processed == _NEG_INF, axis=-1, keepdims=True)
        processed = jnp.where(empty, raw, processed)
    return raw, processed


def _mix(x: jax.Array) -> jax.Array:
    # A 32-bit integer finaliser (lowbias32): every input bit affects every output bit.
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: Array, positions: Array, vocab: int) -> jax.Array:
    """Counter-based uniforms in (0, 1): a pure function of (seed, position, column).

    A hash instead of jax.random's threefry because it compiles about eight
    times faster, and every sampler variant is compiled at warm-up.
    """
    # seeds: [R, 2] uint32, positions: [R] -> [R, V]
    seeds = jnp.asarray(seeds, jnp.uint32)
    row = _mix(seeds[:, 0] ^ _mix(seeds[:, 1] ^ _mix(jnp.asarray(positions).astype(jnp.uint32)
                                                      + jnp.uint32(0x9E3779B9))))
    cols = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    bits = _mix(_mix(row[:, None] + cols * jnp.uint32(0x85EBCA77)) ^ row[:, None])
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    # The top value, 1 - 2**-25, rounds to 1.0 in float32: its Gumbel noise is
    # +inf, and a masked token (-inf) plus +inf is NaN, which argmax picks: a
    # token outside allowed_token_ids about once in 2**24 draws per masked token.
    return jnp.minimum(u, jnp.float32(1.0 - 2.0 ** -24))


def gumbel_noise(seeds: Array, positions: Array, vocab: int) -> jax.Array:
    """Gumbel noise [R, V] keyed by (seed, position, token), as the sampler draws it."""
    return -jnp.log(-jnp.log(uniform_noise(seeds, positions, vocab)))


def token_logprobs(raw: jax.Array, tokens: jax.Array, top_n: int = MAX_LOGPROBS
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ids [N, 1 + n], logprobs [N, 1 + n], ranks [N]) of the chosen tokens and the top n.

    raw: [N, V] model logits, tokens: [N]. A vocabulary smaller than top_n has
    only that many alternatives.
    """
    logp = jax.nn.log_softmax(raw.astype(jnp.float32), axis=-1)
    top_lp, top_ids = jax.lax.top_k(logp, min(top_n, logp.shape[-1]))
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)
    ranks = (logp > chosen).sum(axis=-1).astype(jnp.int32) + 1
    ids = jnp.concatenate([tokens[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return ids, jnp.concatenate([chosen, top_lp], axis=-1), ranks


def sample(logits: jax.Array, tensors: SamplingTensors, variant: SamplerVariant) -> SamplerOutput:
    """Pick one token per row.  logits: [R, V] -> SamplerOutput with token_ids [R]."""
    raw, processed = process(logits.astype(jnp.float32), tensors, variant)
    greedy_tokens = first_argmax(processed)
    if variant.all_greedy:
        tokens = greedy_tokens
    else:
        is_greedy = tensors.temperature <= 0.0
        temp = jnp.where(is_greedy, 1.0, tensors.temperature)[:, None]
        scaled = processed / temp
        scaled = apply_filters(scaled, tensors)
        noise = gumbel_noise(tensors.seeds, tensors.positions, scaled.shape[-1])
        sampled = first_argmax(scaled + noise)
        tokens = jnp.where(is_greedy, greedy_tokens, sampled)
    if not variant.logprobs:
        return SamplerOutput(token_ids=tokens)
    ids, lps, ranks = token_logprobs(raw, tokens)
    return SamplerOutput(token_ids=tokens, logprob_token_ids=ids, logprobs=lps, ranks=ranks)


sample_jit = jax.jit(sample, static_argnames=("variant",))
