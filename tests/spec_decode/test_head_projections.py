"""A head whose projections sit in the CPU kernels' panels (how it is served
beside a packed target on one device) drafts what the checkpoint's layout
does, and its draft pass skips the bucket's padding rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esurge.models import load_model
from esurge.models.coded_linear import CodedLinear
from esurge.models.cpu_kernels import kernel_available
from esurge.models.packed_linear import DUAL_KERNEL_MAX_ROWS, PackedLinear
from esurge.models.rope import rope_cos_sin
from esurge.spec_decode.checkpoint import head_weights, load_eagle_head
from esurge.spec_decode.head import EagleHead, HeadWeights
from esurge.spec_decode.proposer import _rows_through_last

REPO = Path(__file__).resolve().parents[2]
HEAD = REPO / "models" / "tiny-stdlib-eagle"

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler here")


def _draft_pass(head: EagleHead, target: Any, features: jax.Array, ids: jax.Array,
                real: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(hidden [T, H], draft logits [T, Vd]) of one pass with attention to itself only."""
    rows, d = features.shape[0], head.config.head_dim
    positions = jnp.arange(rows, dtype=jnp.int32)
    rope = rope_cos_sin(head.config.rope, d, positions, positions + 1)

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        group = q.shape[1] // v.shape[1]
        return jnp.repeat(v, group, axis=1)  # each row attends to its own position

    hidden = head.step(head.first_hidden(features, real), head.embed(ids, target), rope, attend,
                       real)
    return hidden, head.logits(hidden, target)


@pytest.mark.parametrize("weights", [HeadWeights.PANELS, HeadWeights.DUAL])
# Past DUAL_KERNEL_MAX_ROWS a dual head runs XLA's matmul on its input-major weights.
@pytest.mark.parametrize("rows", [7, DUAL_KERNEL_MAX_ROWS + 8])
def test_packed_projections_draft_as_the_checkpoint_layout(rows: int,
                                                           weights: HeadWeights) -> None:
    target = load_model(REPO / "models" / "tiny-stdlib", "float32")
    reference = load_eagle_head(HEAD, target.config).module()
    packed = load_eagle_head(HEAD, target.config, "float32", weights).module()
    rng = np.random.default_rng(rows)
    features = jnp.asarray(rng.normal(size=(rows, reference.config.feature_size)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, reference.config.vocab_size, rows), jnp.int32)
    real = rows - 3  # the last three rows are bucket padding
    module = target.model_state.module()
    want_hidden, want_logits = _draft_pass(reference, module, features, ids, None)
    hidden, logits = _draft_pass(packed, module, features, ids, jnp.int32(real))
    scale = float(np.abs(np.asarray(want_logits)).max())
    np.testing.assert_allclose(np.asarray(hidden)[:real], np.asarray(want_hidden)[:real],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits)[:real], np.asarray(want_logits)[:real],
                               rtol=1e-4, atol=1e-4 * scale)
    assert (np.asarray(logits)[:real].argmax(-1)
            == np.asarray(want_logits)[:real].argmax(-1)).all()
    if weights is HeadWeights.DUAL and rows > DUAL_KERNEL_MAX_ROWS:
        # XLA's matmul on the input-major weights: every row, as the checkpoint's.
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(want_hidden),
                                   rtol=1e-4, atol=1e-4)
        return
    # num_rows reaches every projection: the real rows are those of a pass over
    # all rows, bit for bit, and the padding rows are not.
    every_hidden, _ = _draft_pass(packed, module, features, ids, None)
    np.testing.assert_array_equal(np.asarray(hidden)[:real], np.asarray(every_hidden)[:real])
    assert not np.allclose(np.asarray(hidden)[real:], np.asarray(every_hidden)[real:])
    # The kernels never computed the padding rows: their projections are zeros.
    padded = np.asarray(packed.fc(features.astype(packed.dtype), jnp.int32(real)))
    assert not padded[real:].any()


@pytest.mark.parametrize("weights", [HeadWeights.PANELS, HeadWeights.DUAL])
def test_a_head_of_bfloat16_values_drafts_bit_for_bit_from_widened_panels(
        weights: HeadWeights, monkeypatch: pytest.MonkeyPatch) -> None:
    target = load_model(REPO / "models" / "tiny-stdlib", "float32")
    widened = load_eagle_head(HEAD, target.config, "float32", weights).module()
    monkeypatch.setenv("ESURGE_WIDENED_PANELS", "0")  # upcast to float32 panels
    upcast = load_eagle_head(HEAD, target.config, "float32", weights).module()
    assert isinstance(widened.fc, CodedLinear) and isinstance(upcast.fc, PackedLinear)
    assert widened.lm_head.weight.panels.dtype == jnp.bfloat16  # type: ignore[union-attr]
    module = target.model_state.module()
    rng = np.random.default_rng(5)
    for rows in (1, 5, 7, 40):
        features = jnp.asarray(rng.normal(size=(rows, upcast.config.feature_size)), jnp.float32)
        ids = jnp.asarray(rng.integers(0, upcast.config.vocab_size, rows), jnp.int32)
        real = jnp.int32(rows)
        for got, want in zip(_draft_pass(widened, module, features, ids, real),
                             _draft_pass(upcast, module, features, ids, real), strict=True):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                          np.asarray(want).view(np.uint32))


def test_widened_panels_are_refused_where_they_would_round() -> None:
    target = load_model(REPO / "models" / "tiny-stdlib", "float32")
    with pytest.raises(ValueError, match="bfloat16 values"):
        load_eagle_head(HEAD, target.config, "bfloat16", HeadWeights.WIDENED)


@pytest.mark.parametrize(("packed", "dual", "on_mesh", "want"), [
    (True, False, False, HeadWeights.PANELS),
    (True, True, False, HeadWeights.DUAL),  # no AVX-512: big buckets on XLA's matmul
    (True, True, True, HeadWeights.PLAIN),  # replicated over a tp mesh
    (False, False, False, HeadWeights.PLAIN),
])
def test_the_head_takes_its_targets_layout(packed: bool, dual: bool, on_mesh: bool,
                                           want: HeadWeights) -> None:
    config = load_model(REPO / "models" / "tiny-stdlib", "float32").config
    config = dataclasses.replace(config, packed_weights=packed, dual_layout=dual,
                                 coded_weights=())
    assert head_weights(config, on_mesh=on_mesh) is want


def test_draft_logits_skip_the_rows_past_the_last_drafting_request() -> None:
    """A lone request in a bucket of 4: each draft step's LM head computes one row."""
    target = load_model(REPO / "models" / "tiny-stdlib", "float32")
    head = load_eagle_head(HEAD, target.config, "float32", HeadWeights.DUAL).module()
    module = target.model_state.module()
    live = jnp.asarray([True, False, False, False])
    real = _rows_through_last(live)
    assert int(real) == 1
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(4, head.config.hidden_size)),
                         jnp.float32)
    every = np.asarray(head.logits(hidden, module))
    some = np.asarray(head.logits(hidden, module, real))
    np.testing.assert_array_equal(some[:1], every[:1])
    assert not some[1:].any() and every[1:].any()


@pytest.mark.parametrize(("live", "rows"), [
    ([False, False, False, False], 0), ([True, False, False, False], 1),
    ([False, True, False, True], 4), ([True, True, True, False], 3)])
def test_draft_steps_compute_the_rows_through_the_last_drafting_one(live: list[bool],
                                                                    rows: int) -> None:
    assert int(_rows_through_last(jnp.asarray(live))) == rows
