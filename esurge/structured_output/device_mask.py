"""Reading the packed grammar masks on the device (bit t % 32 of word t // 32: token t)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["allowed_bits"]


def allowed_bits(allowed: Any,  # [R, W] int32, packed over the target vocabulary
                 token_ids: jax.Array,  # [C] int32: the target token of each column
                 ) -> jax.Array:  # [R, C] bool
    """Whether each row's mask allows each column's token."""
    words = jnp.take(jnp.asarray(allowed, jnp.int32), token_ids >> 5, axis=1)
    return ((words >> (token_ids & 31)) & 1) == 1
