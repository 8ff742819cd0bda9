"""The step's one-transfer input buffer: every array comes back out exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esurge.models.batch import ForwardBatch, tile_layout
from esurge.runner.packed_inputs import pack_inputs


def _batch(rng: np.random.Generator, tile: int) -> ForwardBatch:
    t, r, g, p = 32, 8, 2, 5
    ints = lambda *shape: rng.integers(-3, 1000, shape, dtype=np.int32)  # noqa: E731
    tile_rows, row_in_tiles = (tile_layout(np.array([20, 3, 1]), t, r, tile) if tile > 1
                               else (None, None))
    return ForwardBatch(
        input_ids=ints(t), positions=ints(t), token_req=ints(t), slot_mapping=ints(g, t),
        page_tables=ints(g, r, p), query_start_loc=ints(r + 1), seq_lens=ints(r),
        logits_indices=ints(r), query_tile=tile, tile_rows=tile_rows, row_in_tiles=row_in_tiles)


@pytest.mark.parametrize("tile", [1, 16])
def test_unpack_inside_jit_returns_every_array(tile: int) -> None:
    rng = np.random.default_rng(tile)
    batch = _batch(rng, tile)
    prev_index = rng.integers(-1, 32, 32, dtype=np.int32)
    flat, layout = pack_inputs(batch, prev_index)
    assert flat.shape == (layout.size,) and flat.dtype == np.int32
    got, got_prev, got_burst = jax.jit(layout.unpack)(jnp.asarray(flat))
    assert got.query_tile == tile and got_burst is None and layout.num_steps == 1
    np.testing.assert_array_equal(np.asarray(got_prev), prev_index)
    for name in ("input_ids", "positions", "token_req", "slot_mapping", "page_tables",
                 "query_start_loc", "seq_lens", "logits_indices", "tile_rows", "row_in_tiles"):
        want = getattr(batch, name)
        if want is None:
            assert getattr(got, name) is None
        else:
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), want, err_msg=name)


def test_layout_is_static_per_shape() -> None:
    # The layout is a static jit argument: equal for equal shapes (no recompiles
    # from step to step), different when a bucket changes.
    rng = np.random.default_rng(0)
    prev = np.zeros(32, np.int32)
    (_, a), (_, b) = pack_inputs(_batch(rng, 1), prev), pack_inputs(_batch(rng, 1), prev)
    assert a == b and hash(a) == hash(b)
    assert pack_inputs(_batch(rng, 16), prev)[1] != a


def test_non_int32_input_is_refused() -> None:
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="prev_index must be int32"):
        pack_inputs(_batch(rng, 1), np.zeros(32, np.int64))
