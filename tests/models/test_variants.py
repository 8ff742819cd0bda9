"""Config variants within the families: RoPE scaling types, biases, Qwen2 windowed layers."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from esurge.models import AttentionKind, RopeType
from esurge.models.rope import inverse_frequencies
from tests.models.conftest import Pair
from tests.models.paged import PagedSession, Row, greedy_generate, hf_generate, hf_logits
from tests.models.test_parity import assert_close, tokens

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1 style: llama3 frequency smoothing, plus q/k/v/o and MLP biases.
    "llama3-rope-with-biases": ("llama", {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16},
        "attention_bias": True, "mlp_bias": True,
    }),
    "linear-rope": ("llama", {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    }),
    # Qwen2 with sliding windows on layers >= max_window_layers.
    "qwen2-windowed": ("qwen2", {
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
    }),
}


def prefill_then_decode(pair: Pair, ids: list[int], prefill: int) -> np.ndarray:
    session = PagedSession(pair.loaded, seed=7)
    (first,) = session.step([Row("a", ids[:prefill], 0, num_logits=prefill)])
    rest = [session.step([Row("a", [ids[p]], p)])[0] for p in range(prefill, len(ids))]
    return np.concatenate([first, *rest])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_transformers(make_pair: Callable[..., Pair], variant: str) -> None:
    family, overrides = VARIANTS[variant]
    pair = make_pair(family, **overrides)
    ids = tokens(20, 22)
    assert_close(prefill_then_decode(pair, ids, prefill=9), hf_logits(pair.hf, ids))


def test_variant_configs_are_read(make_pair: Callable[..., Pair]) -> None:
    llama3 = make_pair("llama", **VARIANTS["llama3-rope-with-biases"][1]).loaded.config
    rope = llama3.layers[0].rope
    assert rope.rope_type is RopeType.LLAMA3
    assert (llama3.qkv_bias, llama3.o_bias, llama3.mlp_bias) == (True, True, True)
    default = inverse_frequencies(rope.__class__(RopeType.DEFAULT, 10000.0), 16)
    scaled = inverse_frequencies(rope, 16)
    # Wavelength 2*pi lies between 16/4 and 16/1: interpolated between scaled and unscaled.
    smooth = (16 / (2 * math.pi) - 1.0) / (4.0 - 1.0)
    assert scaled[0] == pytest.approx((1 - smooth) / 8.0 + smooth, rel=1e-6)
    assert scaled[-1] == pytest.approx(default[-1] / 8.0, rel=1e-6)  # long waves: divided
    qwen = make_pair("qwen2", **VARIANTS["qwen2-windowed"][1]).loaded.config
    assert [(layer.kind, layer.window) for layer in qwen.layers] == [
        (AttentionKind.FULL, None), (AttentionKind.SLIDING, 8)]


def _reset_dynamic_rope(hf: Any) -> None:
    """transformers' dynamic RoPE keeps state across calls; start each use afresh."""
    rotary = hf.model.rotary_emb
    rotary.inv_freq = rotary.original_inv_freq.clone()
    rotary.max_seq_len_cached = rotary.original_max_seq_len


def test_dynamic_rope_past_its_original_length(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("llama", max_position_embeddings=16,
                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                      "factor": 2.0})
    assert pair.loaded.config.layers[0].rope.rope_type is RopeType.DYNAMIC
    prompt = tokens(21, 20)  # longer than max_position_embeddings: the base is rescaled
    (got,) = PagedSession(pair.loaded).step([Row("a", prompt, 0, num_logits=len(prompt))])
    _reset_dynamic_rope(pair.hf)
    assert_close(got, hf_logits(pair.hf, prompt))
    _reset_dynamic_rope(pair.hf)
    theirs = hf_generate(pair.hf, prompt, 12)
    assert greedy_generate(PagedSession(pair.loaded), [prompt], 12) == [theirs]
