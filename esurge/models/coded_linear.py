"""Linear layers whose weight stays a GGUF's integer codes, in column panels.

The serving layout where a GGUF stores a projection in an affine block format
(esurge.models.weight_codes) and the CPU kernels serve float32: the codes,
scales and offsets are packed into the panels of esurge.models.packed_linear
(same column order, so the float32 panel packing defines both) and the C++
kernel expands each panel to float32 in cache before multiplying
(cpu_kernels/coded_matmul.cc). A decode step then streams about a sixth of
the float32 weight's bytes (4-bit codes) and gets exactly the float32 panel
kernel's result on the dequantized weight.

Where the model also keeps the input-major float32 weight (dual layout, CPUs
without AVX-512), buckets past DUAL_KERNEL_MAX_ROWS multiply by it with XLA,
as the float32 panel modules do.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from esurge.models.cpu_kernels import PANEL, coded_matmul_kernel
from esurge.models.packed_linear import pack_gate_up, pack_weight, plain_serves
from esurge.models.weight_codes import CODE_BLOCK, WeightCodes

__all__ = ["CodedGateUp", "CodedLinear", "code_bytes", "pack_codes", "pack_gate_up_codes"]

_HALF = PANEL // 2


def code_bytes(bits: int) -> int:
    """Bytes per panel row: 4-bit codes two to a byte, 8-bit one."""
    return PANEL // 2 if bits == 4 else PANEL


def _column_map(pack: Callable[[jax.Array], jax.Array], out_features: int) -> np.ndarray:
    """[P, PANEL]: the weight column each panel slot holds (-1: padding), read
    off the float32 packing of a one-row weight of column numbers."""
    numbers = jnp.arange(1, out_features + 1, dtype=jnp.float32)[None, :]  # [1, out]
    return np.asarray(pack(numbers))[:, 0, :].astype(np.int64) - 1


def _panels(codes: WeightCodes, columns: np.ndarray) -> dict[str, np.ndarray]:
    """codes [out, in] gathered into the panel slots of `columns` [P, PANEL]."""
    valid = columns >= 0
    safe = np.where(valid, columns, 0)

    def gather(per_column: np.ndarray) -> np.ndarray:  # [rows, out] -> [P, rows, PANEL]
        taken = per_column[:, safe] * valid.astype(per_column.dtype)  # [rows, P, PANEL]
        return np.ascontiguousarray(taken.transpose(1, 0, 2))

    q = gather(codes.codes.T)
    if codes.bits == 4:  # slot j and slot j + 16 share byte j (low, high nibble)
        q = (q[..., :_HALF] | (q[..., _HALF:] << np.uint8(4))).astype(np.uint8)
    else:
        q = q.view(np.uint8)
    return {"codes": q, "scale": gather(codes.scale.T), "offset": gather(codes.offset.T)}


def pack_codes(codes: WeightCodes) -> dict[str, np.ndarray]:
    """A projection's codes ([out, in]) in the column panels of pack_weight."""
    return _panels(codes, _column_map(pack_weight, codes.shape[0]))


def pack_gate_up_codes(codes: WeightCodes, intermediate: int) -> dict[str, np.ndarray]:
    """A fused gate/up weight's codes ([2I, in], gate rows first) in the SiLU
    panels of pack_gate_up."""
    return _panels(codes, _column_map(lambda w: pack_gate_up(w, intermediate), 2 * intermediate))


class _CodedPanels(nnx.Module):
    """The codes, scales and offsets of one packed weight."""

    def __init__(self, in_features: int, panels: int, bits: int):
        if in_features % CODE_BLOCK:
            raise ValueError(f"coded weights need in_features divisible by {CODE_BLOCK}, "
                             f"got {in_features}")
        self.codes = nnx.Param(jnp.zeros((panels, in_features, code_bytes(bits)), jnp.uint8))
        blocks = in_features // CODE_BLOCK
        self.scale = nnx.Param(jnp.zeros((panels, blocks, PANEL), jnp.float32))
        self.offset = nnx.Param(jnp.zeros((panels, blocks, PANEL), jnp.float32))
        self.bits = bits

    def matmul(self, x: jax.Array, out_features: int, num_rows: jax.Array | None,
               silu_mul: bool) -> jax.Array:  # [T, in] -> [T, out_features]
        return coded_matmul_kernel(x, self.codes[...], self.scale[...], self.offset[...],
                                   out_features, self.bits, num_rows, silu_mul=silu_mul)


class CodedLinear(nnx.Module):
    """y = x W + b with W as codes in column panels (dual: also input-major float32)."""

    def __init__(self, in_features: int, out_features: int, *, bits: int, bias: bool,
                 dtype: jnp.dtype, dual: bool = False):
        self.weight = _CodedPanels(in_features, -(-out_features // PANEL), bits)
        self.plain = (nnx.Param(jnp.zeros((in_features, out_features), dtype)) if dual
                      else None)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.out_features = out_features

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, in] -> [T, out]
        y = (x @ self.plain[...] if plain_serves(x, self.plain)  # type: ignore[index]
             else self.weight.matmul(x, self.out_features, num_rows, silu_mul=False))
        return y if self.bias is None else y + self.bias[...]


class CodedGateUp(nnx.Module):
    """silu(x W_gate) * (x W_up) from codes in the SiLU panels (no biases)."""

    def __init__(self, in_features: int, intermediate: int, *, bits: int, dtype: jnp.dtype,
                 dual: bool = False):
        self.weight = _CodedPanels(in_features, -(-intermediate // _HALF), bits)
        self.plain = (nnx.Param(jnp.zeros((in_features, 2 * intermediate), dtype)) if dual
                      else None)
        self.intermediate = intermediate

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, in] -> [T, intermediate]
        if plain_serves(x, self.plain):
            y = x @ self.plain[...]  # type: ignore[index]
            return jax.nn.silu(y[:, :self.intermediate]) * y[:, self.intermediate:]
        return self.weight.matmul(x, self.intermediate, num_rows, silu_mul=True)
