"""The head's serving dtype beside its target, and a bfloat16 head fed float32 inputs."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from esurge.models import load_model
from esurge.models.cpu_kernels import kernels_serve
from esurge.spec_decode.checkpoint import head_serving_dtype, load_eagle_head
from esurge.spec_decode.head import HeadWeights

REPO = Path(__file__).resolve().parents[2]


def test_bfloat16_heads_only_beside_packed_float32_targets_on_native_bfloat16() -> None:
    native = kernels_serve(jnp.bfloat16)
    for packed in (HeadWeights.PANELS, HeadWeights.DUAL):
        assert head_serving_dtype("float32", packed) == ("bfloat16" if native else "float32")
        assert head_serving_dtype("bfloat16", packed) == "bfloat16"
    assert head_serving_dtype("float32", HeadWeights.PLAIN) == "float32"


def test_a_bfloat16_head_casts_float32_features_on_entry() -> None:
    target = load_model(REPO / "models" / "tiny-stdlib", "float32")
    head32 = load_eagle_head(REPO / "models" / "tiny-stdlib-eagle", target.config, "float32")
    head16 = load_eagle_head(REPO / "models" / "tiny-stdlib-eagle", target.config, "bfloat16")
    features = np.random.default_rng(0).normal(size=(3, head32.config.feature_size))
    feats = jnp.asarray(features, jnp.float32)
    want, got = head32.module().first_hidden(feats), head16.module().first_hidden(feats)
    assert got.dtype == jnp.bfloat16
    # The checkpoint is bfloat16: both heads hold the same weights, so they
    # differ only by bfloat16 rounding of the input and the product.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=0.05,
                               atol=0.05 * float(np.abs(np.asarray(want)).max()))
