"""Reductions written the way XLA's CPU backend compiles them well.

`jnp.argmax` lowers to a variadic (value, index) reduce that XLA:CPU runs as
a scalar loop, and a producer fused into it runs inside that loop: Gumbel-max
sampling of 16 rows of SmolLM2's 49,152 logits took 12.4 ms as
`argmax(logits + noise)` and 1.6 ms as a max followed by a search for its
first position (two plain reductions, both vectorised).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["first_argmax"]


def first_argmax(x: jax.Array  # [..., V]
                 ) -> jax.Array:
    """[...] int32: the first index of each row's maximum, as `jnp.argmax`
    (a NaN counts as the maximum, and its first position is returned)."""
    top = x.max(axis=-1, keepdims=True)
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1).astype(jnp.int32)
