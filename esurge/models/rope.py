"""Rotary position embeddings: frequency schemes and their application per token.

Frequencies are computed in float32 as transformers does. Dynamic NTK scaling
depends on the sequence length; transformers uses the longest position of the
current call, which for one request is its context length after the step, so
here every token uses its own request's `seq_len` (identical for a single
request whether it is prefilled whole, in chunks or decoded step by step).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from esurge.models.decoder_config import RopeConfig, RopeType

__all__ = ["apply_rope", "inverse_frequencies", "rope_cos_sin"]


def _base_frequencies(theta: float, head_dim: int) -> np.ndarray:  # [head_dim // 2]
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def _llama3_frequencies(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    if (rope.low_freq_factor is None or rope.high_freq_factor is None
            or rope.original_max_position_embeddings is None):
        raise ValueError("llama3 RoPE needs low_freq_factor, high_freq_factor and "
                         "original_max_position_embeddings")
    old_len = float(rope.original_max_position_embeddings)
    low, high = float(rope.low_freq_factor), float(rope.high_freq_factor)
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > old_len / low, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:  # [head_dim // 2]
    """Static inverse frequencies; for dynamic RoPE, those used within the original length."""
    inv_freq = _base_frequencies(rope.theta, head_dim)
    if rope.rope_type is RopeType.LINEAR:
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type is RopeType.LLAMA3:
        return _llama3_frequencies(rope, inv_freq)
    return inv_freq


def _dynamic_frequencies(
    rope: RopeConfig, head_dim: int, seq_lens: jax.Array  # [T]
) -> jax.Array:  # [T, head_dim // 2]
    if rope.max_position_embeddings is None:
        raise ValueError("dynamic RoPE needs max_position_embeddings")
    max_pos = float(rope.max_position_embeddings)
    length = jnp.maximum(seq_lens.astype(jnp.float32), max_pos)
    growth = (rope.factor * length / max_pos) - (rope.factor - 1.0)
    base = rope.theta * growth ** (head_dim / (head_dim - 2))  # [T]
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (base[:, None] ** exponents[None, :])


def rope_cos_sin(
    rope: RopeConfig,
    head_dim: int,
    positions: jax.Array,  # [T] int32
    seq_lens: jax.Array,  # [T] int32: context length of each token's request
) -> tuple[jax.Array, jax.Array]:  # 2 x [T, head_dim] float32
    """cos and sin tables for each token, halves repeated as transformers lays them out."""
    if rope.rope_type is RopeType.DYNAMIC:
        inv_freq = _dynamic_frequencies(rope, head_dim, seq_lens)
    else:
        inv_freq = jnp.asarray(inverse_frequencies(rope, head_dim))[None, :]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(
    x: jax.Array,  # [T, heads, head_dim]
    cos: jax.Array,  # [T, head_dim]
    sin: jax.Array,  # [T, head_dim]
) -> jax.Array:  # [T, heads, head_dim]
    """Rotate x by the tables, in x's dtype (the tables are cast first, as transformers does)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos_x = cos.astype(x.dtype)[:, None, :]
    sin_x = sin.astype(x.dtype)[:, None, :]
    return x * cos_x + rotated * sin_x
