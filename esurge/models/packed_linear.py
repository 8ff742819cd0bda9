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

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.models.cpu_kernels import PANEL, kernels_serve, packed_matmul_kernel

__all__ = ["PANEL", "PackedLinear", "num_panels", "pack_weight", "packed_matmul",
           "unpack_weight"]


def num_panels(out_features: int) -> int:
    """Panels that hold out_features columns."""
    return -(-out_features // PANEL)


def pack_weight(weight: jax.Array) -> jax.Array:  # [in, out] -> [P, in, PANEL]
    """The packed form of an input-major weight (padding columns are zero)."""
    k, n = weight.shape
    padded = jnp.pad(weight, ((0, 0), (0, num_panels(n) * PANEL - n)))
    return padded.reshape(k, -1, PANEL).transpose(1, 0, 2)


def unpack_weight(packed: jax.Array, out_features: int) -> jax.Array:  # [P, in, PANEL]
    """The input-major weight [in, out_features] back from its packed form."""
    p, k, _ = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, p * PANEL)[:, :out_features]


def packed_matmul(
    x: jax.Array,  # [T, in]
    packed: jax.Array,  # [P, in, PANEL]
    out_features: int,
    num_rows: jax.Array | None = None,  # [] int32: real rows; the rest is padding
) -> jax.Array:  # [T, out_features]
    """x @ W for a packed W: the CPU kernel for float32, else XLA.

    Rows at or past num_rows are padding: the kernel returns zeros for them
    without computing them; the XLA path computes them like the others.
    """
    if x.dtype == jnp.float32 and packed.dtype == jnp.float32 and kernels_serve(jnp.float32):
        return packed_matmul_kernel(x, packed, out_features, num_rows)
    y = jnp.einsum("tk,pkn->tpn", x, packed).reshape(x.shape[0], -1)
    return y[:, :out_features]


class PackedLinear(nnx.Module):
    """y = x W + b with W stored packed, [P, in_features, PANEL]."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.zeros((num_panels(out_features), in_features, PANEL), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.out_features = out_features

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, in] -> [T, out]
        y = packed_matmul(x, self.weight[...], self.out_features, num_rows)
        if self.bias is not None:
            y = y + self.bias[...]
        return y
