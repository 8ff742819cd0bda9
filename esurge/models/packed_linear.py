"""Linear layers whose weight is packed once into contiguous column panels.

The serving layout on XLA:CPU (`load_model` packs when the CPU kernels serve
the model's dtype): a weight [in, out] becomes [P, in, PANEL] with panel p
holding output columns [p * PANEL, (p + 1) * PANEL), zero-padded at the end.
Matmuls then run in the C++ kernel of `esurge.models.cpu_kernels`, which
streams each panel sequentially instead of walking the weight with page-sized
strides: 2x XLA's rate for decode-sized (few-row) steps, level with it to
~10% behind on 2048-row prefill steps, where it makes up the difference by
skipping the bucket's padding rows (XLA computes them) and by reading the
packed layout directly (XLA would transpose every weight back first).
Elsewhere (other platforms or dtypes, no compiler) one einsum reads the packed
weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.models.cpu_kernels import (
    PANEL,
    cpu_has_avx512,
    kernels_serve,
    packed_matmul_kernel,
)

__all__ = ["PANEL", "PackedGateUp", "PackedLinear", "num_panels", "pack_gate_up", "pack_weight",
           "packed_matmul", "packed_silu_mul"]

_HALF = PANEL // 2  # gate (or up) columns per panel of a PackedGateUp


def num_panels(out_features: int) -> int:
    """Panels that hold out_features columns."""
    return -(-out_features // PANEL)


def pack_weight(weight: jax.Array) -> jax.Array:  # [in, out] -> [P, in, PANEL]
    """The packed form of an input-major weight (padding columns are zero)."""
    k, n = weight.shape
    padded = jnp.pad(weight, ((0, 0), (0, num_panels(n) * PANEL - n)))
    return padded.reshape(k, -1, PANEL).transpose(1, 0, 2)


# Most rows (a bucket's, known when tracing) the kernel takes where the CPU
# lacks AVX-512: with 16 vector registers its row tiles are 2 rows, and from
# a few dozen rows XLA's blocked matmul over the same panels wins (measured on
# a Zen 3: 128 rows of a [576, 3072] weight, 43 ms in the kernel, 9 ms in XLA;
# at 1 real row of a 16-row bucket the kernel, skipping padding, takes 0.7 ms
# against XLA's 3 ms for all 16). With AVX-512 the kernel serves every size.
_AVX2_MAX_ROWS = 16


@functools.cache
def _kernel_max_rows() -> int | None:
    return None if cpu_has_avx512() else _AVX2_MAX_ROWS


def _kernel_takes(x: jax.Array, packed: jax.Array, serving: bool) -> bool:
    """serving: the model's own call, which takes XLA past the row limit."""
    if not (x.dtype == packed.dtype == jnp.float32 and kernels_serve(jnp.float32)):
        return False
    limit = _kernel_max_rows() if serving else None
    return limit is None or x.shape[0] <= limit


def packed_matmul(
    x: jax.Array,  # [T, in]
    packed: jax.Array,  # [P, in, PANEL]
    out_features: int,
    num_rows: jax.Array | None = None,  # [] int32: real rows; the rest is padding
    *,
    serving: bool = False,
) -> jax.Array:  # [T, out_features]
    """x @ W for a packed W: the CPU kernel for float32, else XLA.

    Rows at or past num_rows are padding: the kernel returns zeros for them
    without computing them; the XLA path computes them like the others.
    serving: pick the faster of the two for this many rows on this CPU (the
    kernel only up to _AVX2_MAX_ROWS rows without AVX-512).
    """
    if _kernel_takes(x, packed, serving):
        return packed_matmul_kernel(x, packed, out_features, num_rows)
    y = jnp.einsum("tk,pkn->tpn", x, packed).reshape(x.shape[0], -1)
    return y[:, :out_features]


def pack_gate_up(weight: jax.Array, intermediate: int) -> jax.Array:  # [in, 2I] -> [P, in, PANEL]
    """A fused gate/up weight (gate columns first) packed for the SiLU epilogue:
    panel p holds gate columns [16p, 16p + 16) then the same up columns."""
    k = weight.shape[0]
    p = -(-intermediate // _HALF)
    halves = [jnp.pad(part, ((0, 0), (0, p * _HALF - intermediate))).reshape(k, p, _HALF)
              for part in (weight[:, :intermediate], weight[:, intermediate:])]
    return jnp.concatenate(halves, axis=-1).transpose(1, 0, 2)


def packed_silu_mul(
    x: jax.Array,  # [T, in]
    packed: jax.Array,  # [P, in, PANEL] from pack_gate_up
    intermediate: int,
    num_rows: jax.Array | None = None,  # [] int32: real rows; the rest is padding
    *,
    serving: bool = False,
) -> jax.Array:  # [T, intermediate]
    """silu(x @ W_gate) * (x @ W_up), the activation applied in the kernel's epilogue
    (so the [T, 2I] product is never written); XLA elsewhere. serving: as for
    packed_matmul."""
    if _kernel_takes(x, packed, serving):
        return packed_matmul_kernel(x, packed, intermediate, num_rows, silu_mul=True)
    y = jnp.einsum("tk,pkn->tpn", x, packed)
    gate = y[..., :_HALF].reshape(x.shape[0], -1)[:, :intermediate]
    up = y[..., _HALF:].reshape(x.shape[0], -1)[:, :intermediate]
    return jax.nn.silu(gate) * up


class PackedGateUp(nnx.Module):
    """silu(x W_gate) * (x W_up) with both weights packed by pack_gate_up (no biases)."""

    def __init__(self, in_features: int, intermediate: int, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((-(-intermediate // _HALF), in_features, PANEL), dtype))
        self.intermediate = intermediate

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, in] -> [T, intermediate]
        return packed_silu_mul(x, self.weight[...], self.intermediate, num_rows, serving=True)


class PackedLinear(nnx.Module):
    """y = x W + b with W stored packed, [P, in_features, PANEL]."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((num_panels(out_features), in_features, PANEL), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.out_features = out_features

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, in] -> [T, out]
        y = packed_matmul(x, self.weight[...], self.out_features, num_rows, serving=True)
        if self.bias is not None:
            y = y + self.bias[...]
        return y
