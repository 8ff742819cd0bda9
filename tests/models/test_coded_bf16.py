"""A GGUF's integer codes multiplied in bfloat16 (cpu_kernels/coded_bf16_matmul.cc).

The kernel's promise: the float32 product of the bfloat16 activations with the
exact dequantized weight (the codes are never rounded), rounded once to
bfloat16. So the result is within half a bfloat16 unit of that product plus
float32 accumulation noise, whichever row count (tiles of up to 12 rows, one
or several) and with padding rows left zero. A model served
so follows its float32 serving (test_bf16_kernels:
test_a_quantized_gguf_served_in_bfloat16_follows_its_float32_serving).
"""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from esurge.models.coded_linear import pack_codes, pack_gate_up_codes
from esurge.models.cpu_kernels import coded_matmul_kernel
from esurge.models.weight_codes import WeightCodes, weight_codes
from tests.models.test_bf16_kernels import HALF_UNIT, native


def _codes(rng: np.random.Generator, kind: str, out: int, inputs: int
           ) -> tuple[WeightCodes, np.ndarray]:
    """Codes of a random weight in the GGUF format `kind`, and gguf's own
    float32 dequantization [out, in]."""
    weight = (rng.standard_normal((out, inputs)) * rng.uniform(1e-3, 2.0, (out, 1)))
    raw = gguf.quants.quantize(weight.astype(np.float32), Q[kind])
    codes = weight_codes(raw, kind, (out, inputs))
    assert codes is not None
    return codes, gguf.quants.dequantize(raw, Q[kind]).astype(np.float32)


def _panels(packed: dict[str, np.ndarray]) -> tuple[jnp.ndarray, ...]:
    return tuple(jnp.asarray(packed[k]) for k in ("codes", "scale", "offset"))


def _assert_rounded_from(got: jnp.ndarray, want: np.ndarray) -> None:
    """got (bfloat16) is want rounded once, give or take float32 accumulation noise."""
    assert got.dtype == jnp.bfloat16
    got64 = np.asarray(got.astype(jnp.float32), np.float64)
    noise = 1e-5 * (np.abs(want).max() + 1.0)
    excess = np.abs(got64 - want) - (HALF_UNIT * np.abs(want) + noise)
    assert float(excess.max()) <= 0, f"off by {float(excess.max())} beyond half a unit"


@native
@pytest.mark.usefixtures("cpu_kernels_built")
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q5_1"])  # 4-bit, 8-bit, 5-bit codes
@pytest.mark.parametrize(("m", "rows"), [(1, 1), (4, 3), (8, 8), (16, 12), (16, 13), (40, 37)])
def test_coded_bf16_matmul_is_the_exact_weights_product_rounded_once(kind: str, m: int,
                                                                     rows: int) -> None:
    rng = np.random.default_rng(m * 31 + rows)
    out, inputs = 72, 96  # a partial last panel; three blocks of 32 inputs
    codes, dequantized = _codes(rng, kind, out, inputs)
    x = jnp.asarray(rng.standard_normal((m, inputs)), jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)[:rows]
    real = jnp.int32(rows)  # rows past it are bucket padding
    got = coded_matmul_kernel(x, *_panels(pack_codes(codes)), out, codes.bits, real)
    _assert_rounded_from(got[:rows], x64 @ dequantized.T.astype(np.float64))
    assert not np.asarray(got.astype(jnp.float32))[rows:].any()

    # float32 results (the LM head's logits): the same sums, not rounded.
    sums = coded_matmul_kernel(x, *_panels(pack_codes(codes)), out, codes.bits, real,
                               float32_out=True)
    assert sums.dtype == jnp.float32
    want = x64 @ dequantized.T.astype(np.float64)
    np.testing.assert_allclose(np.asarray(sums)[:rows], want, rtol=1e-5,
                               atol=1e-5 * (np.abs(want).max() + 1.0))
    np.testing.assert_array_equal(np.asarray(sums.astype(jnp.bfloat16).astype(jnp.float32)),
                                  np.asarray(got.astype(jnp.float32)))

    half = out // 2
    gated = coded_matmul_kernel(x, *_panels(pack_gate_up_codes(codes, half)), half, codes.bits,
                                real, silu_mul=True)
    h = x64 @ dequantized.T.astype(np.float64)
    gate, up = h[:, :half], h[:, half:]
    # The SiLU is applied to the float32 sums before the one rounding.
    _assert_rounded_from(gated[:rows], gate / (1.0 + np.exp(-gate)) * up)
