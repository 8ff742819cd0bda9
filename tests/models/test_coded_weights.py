"""GGUF weights served from their integer codes: the decoders, the kernel, the layout.

The promise of esurge.models.weight_codes and cpu_kernels/coded_matmul.cc is
exactness: the codes dequantize to gguf's own float32 values, and the coded
kernel returns bit for bit what the float32 panel kernel returns on them.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from esurge.models.coded_linear import pack_codes, pack_gate_up_codes
from esurge.models.cpu_kernels import coded_matmul_kernel, kernel_available, packed_matmul_kernel
from esurge.models.decoder_config import (
    Activation,
    AttentionKind,
    DecoderConfig,
    LayerAttention,
    RopeConfig,
    RopeType,
)
from esurge.models.loader import load_model
from esurge.models.packed_linear import pack_gate_up, pack_weight
from esurge.models.weight_codes import CODED_TYPES, WeightCodes, weight_codes
from tests.models.checkpoints import build_model, hf_config, save_checkpoint
from tests.models.gguf_export import export_gguf

needs_kernels = pytest.mark.skipif(not kernel_available(), reason="no C++ compiler here")


def _weight(rng: np.random.Generator, out: int, inputs: int) -> np.ndarray:
    # Rows of very different magnitudes, so scales span float16's range.
    scale = rng.uniform(1e-3, 4.0, (out, 1))
    return (rng.standard_normal((out, inputs)) * scale).astype(np.float32)


def _q4_k_blocks(rng: np.random.Generator, out: int, inputs: int) -> np.ndarray:
    """Random Q4_K bytes (gguf's Python side cannot quantize to Q4_K)."""
    blocks = rng.integers(0, 256, (out * inputs // 256, 144), dtype=np.uint8)
    d = rng.uniform(-0.05, 0.05, (blocks.shape[0], 2)).astype(np.float16)
    blocks[:, :4] = d.view(np.uint8)
    return blocks.reshape(out, -1)


def _raw(kind: str, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if kind == "Q4_K":
        return _q4_k_blocks(rng, *weight.shape)
    return gguf.quants.quantize(weight, Q[kind])


@pytest.mark.parametrize("kind", CODED_TYPES)
def test_codes_dequantize_to_ggufs_own_values(kind: str) -> None:
    rng = np.random.default_rng(3)
    raw = _raw(kind, _weight(rng, 48, 512), rng)
    codes = weight_codes(raw, kind, (48, 512))
    assert codes is not None
    expected = gguf.quants.dequantize(raw, Q[kind])
    # Equal values (a zero may differ in sign only: -0 * x + 0 is +0).
    np.testing.assert_array_equal(codes.dequantize(), expected)
    assert codes.codes.dtype == (np.uint8 if codes.bits == 4 else np.int8)


def test_formats_without_an_affine_form_have_no_codes() -> None:
    raw = np.zeros((4, 210), np.uint8)  # one Q6_K block per row: 16-input sub-blocks
    assert weight_codes(raw, "Q6_K", (4, 256)) is None
    assert weight_codes(np.zeros((4, 32), np.float32), "F32", (4, 32)) is None


def _panels(codes: WeightCodes, gate_up: int | None) -> tuple[jnp.ndarray, ...]:
    packed = pack_codes(codes) if gate_up is None else pack_gate_up_codes(codes, gate_up)
    return tuple(jnp.asarray(packed[k]) for k in ("codes", "scale", "offset"))


@needs_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 17])
def test_coded_kernel_is_bit_identical_to_the_float32_panel_kernel(kind: str,
                                                                   rows: int) -> None:
    rng = np.random.default_rng(rows)
    out, inputs = 72, 96  # a partial last panel
    raw = gguf.quants.quantize(_weight(rng, out, inputs), Q[kind])
    codes = weight_codes(raw, kind, (out, inputs))
    assert codes is not None
    dequantized = jnp.asarray(gguf.quants.dequantize(raw, Q[kind]).T)  # [in, out]
    x = jnp.asarray(rng.standard_normal((rows + 2, inputs)).astype(np.float32))
    real = jnp.int32(rows)  # the last two rows are bucket padding
    got = coded_matmul_kernel(x, *_panels(codes, None), out, codes.bits, real)
    want = packed_matmul_kernel(x, pack_weight(dequantized), out, real)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
    assert not np.asarray(got)[rows:].any()
    gate = coded_matmul_kernel(x, *_panels(codes, out // 2), out // 2, codes.bits, real,
                               silu_mul=True)
    want_gate = packed_matmul_kernel(x, pack_gate_up(dequantized, out // 2), out // 2, real,
                                     silu_mul=True)
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(want_gate))


@needs_kernels
@pytest.mark.parametrize(("qtype", "coded"), [
    (Q.Q4_1, (("down_proj", 4), ("gate_up_proj", 4), ("lm_head", 4), ("o_proj", 4),
              ("qkv_proj", 4))),
    (Q.Q5_0, (("down_proj", 8), ("gate_up_proj", 8), ("lm_head", 8), ("o_proj", 8),
              ("qkv_proj", 8))),
    (Q.F16, ()),
], ids=["Q4_1", "Q5_0", "F16"])
def test_a_gguf_serves_the_roles_it_codes(qtype: Q, coded: tuple[tuple[str, int], ...],
                                          tmp_path: Path) -> None:
    # Tied embeddings: the embedding's codes serve as the LM head's.
    model = build_model(hf_config("llama", hidden_size=256, intermediate_size=512,
                                  tie_word_embeddings=True), seed=2)
    save_checkpoint(model, tmp_path / "hf")
    path = export_gguf(tmp_path / "hf", "llama", tmp_path / "m.gguf", qtype=qtype)
    loaded = load_model(path)
    assert loaded.config.coded_weights == coded
    if coded:
        layer = loaded.params["model"]["layers"][0]
        assert layer["self_attn"]["qkv_proj"]["weight"]["codes"].dtype == jnp.uint8


def test_coded_weights_are_validated() -> None:
    layer = LayerAttention(AttentionKind.FULL, None, RopeConfig(RopeType.DEFAULT, 10000.0))

    def config(**fields: object) -> DecoderConfig:
        return DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_heads=2,
                             num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
                             activation=Activation.SILU, layers=(layer,), **fields)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="coded_weights need packed_weights"):
        config(coded_weights=(("qkv_proj", 4),))
    packed = {"fused_projections": True, "packed_weights": True}
    with pytest.raises(ValueError, match="the role must be one of"):
        config(**packed, coded_weights=(("q_proj", 4),))
    with pytest.raises(ValueError, match="the role must be one of"):
        config(**packed, coded_weights=(("o_proj", 5),))
    assert config(**packed, coded_weights=(("o_proj", 8),)).code_bits("o_proj") == 8


@pytest.mark.parametrize(("indices", "rows"), [
    ([0, 0, 0, 0], 1),  # one request (or none): one row
    ([3, 9, 12, 0, 0, 0], 3),  # three requests' last tokens, then bucket padding
    ([2, 3, 4, 0, 7, 0, 0, 0], 5),  # verifying drafts: request 1's rows start at slot 4
])
def test_logits_rows_ends_at_the_last_real_row(indices: list[int], rows: int) -> None:
    from esurge.models.forward import logits_rows

    assert int(logits_rows(jnp.asarray(indices, jnp.int32))) == rows
