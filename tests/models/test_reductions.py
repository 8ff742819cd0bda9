"""first_argmax picks what jnp.argmax picks: first maximum, ties, NaN, -inf rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esurge.models.reductions import first_argmax


@pytest.mark.parametrize("seed", range(4))
def test_first_argmax_is_jnp_argmax(seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 3, 257)).astype(np.float32)
    x[0, 0, [5, 9, 200]] = 50.0  # ties: the first wins
    x[1, 1, :] = -np.inf  # a row with no finite value
    x[2, 2, [7, 30]] = np.nan  # NaN counts as the maximum, first one
    x[3, 0, 4] = np.inf
    x[3, 0, 100] = np.inf
    x[4, 1, :] = 0.0
    x[4, 1, 3] = -0.0
    x[5, 2, [0, 256]] = 9.0  # the first and last columns
    got = jax.jit(first_argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
    assert int(got[0, 0]) == 5 and int(got[2, 2]) == 7 and int(got[5, 2]) == 0
