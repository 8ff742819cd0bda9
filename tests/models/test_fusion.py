"""Fused serving projections: the same logits as the checkpoint's own module tree."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from esurge.models import load_model
from tests.models.conftest import Pair
from tests.models.paged import PagedSession, Row


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])  # qkv biases; gelu and sandwich norms
def test_fused_and_unfused_give_the_same_logits(make_pair: Callable[..., Pair],
                                                family: str) -> None:
    pair = make_pair(family)
    unfused = load_model(pair.path, fuse=False)
    assert pair.loaded.config.fused_projections and not unfused.config.fused_projections
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 256, 19)]
    rows = [Row("a", ids, 0, num_logits=len(ids))]
    (fused_logits,) = PagedSession(pair.loaded).step(rows)
    (plain_logits,) = PagedSession(unfused).step(rows)
    assert np.ptp(plain_logits) > 1.0
    np.testing.assert_allclose(fused_logits, plain_logits, atol=1e-5, rtol=0)


def test_fused_layout_is_input_major_and_drops_the_separate_projections(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("qwen2")
    fused = load_model(pair.path, pack=False)  # packing is test_packed_linear's subject
    config = fused.config
    layer = fused.model_state.params["model"]["layers"][0]
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    assert set(layer["self_attn"]) == {"qkv_proj", "o_proj"}
    assert layer["self_attn"]["qkv_proj"]["weight"].shape == (config.hidden_size,
                                                              q_out + 2 * kv_out)
    assert layer["self_attn"]["qkv_proj"]["bias"].shape == (q_out + 2 * kv_out,)
    assert set(layer["mlp"]) == {"gate_up_proj", "down_proj"}
    assert layer["mlp"]["gate_up_proj"]["weight"].shape == (config.hidden_size,
                                                            2 * config.intermediate_size)
    plain = load_model(pair.path, fuse=False).model_state.params["model"]["layers"][0]
    np.testing.assert_array_equal(np.asarray(layer["self_attn"]["qkv_proj"]["weight"])[:, :q_out],
                                  np.asarray(plain["self_attn"]["q_proj"]["weight"]).T)
