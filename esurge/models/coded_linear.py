"""Linear layers whose weight stays a GGUF's integer codes, in column panels.

The serving layout where a GGUF stores a projection in an affine block format
(esurge.models.weight_codes) and the CPU kernels serve float32: the codes,
scales and offsets are packed in the column order of esurge.models.
packed_linear's float32 panels (tests hold the two to bit-identical
products), and the C++ kernel expands each panel to float32 in cache before multiplying
(cpu_kernels/coded_matmul.cc). A decode step then streams about a sixth of
the float32 weight's bytes (4-bit codes) and gets exactly the float32 panel
kernel's result on the dequantized weight. A bfloat16 checkpoint served in
float32 keeps its own values the same way (bits WIDENED_BITS: bfloat16 panels,
cpu_kernels/widened_matmul.cc): half the bytes of float32 panels, the same
products bit for bit.

Where the model also keeps the input-major float32 weight (dual layout, CPUs
without AVX-512), the kernel serves the buckets the float32 panel kernel
serves (packed_linear.DUAL_KERNEL_MAX_ROWS) and XLA's matmul on that weight
the larger ones. Since the AVX2 tiles run in registers, the coded kernel is
level with or ahead of XLA's matmul up to 128 rows, and it skips the bucket's
padding rows (`bench/kernel_rows.py` on a 2-core AMD EPYC with AVX2 only,
SmolLM2's shapes, coded / XLA time: 0.39-0.82 at 1 row, 0.91-1.04 at 4,
0.60-0.92 at 16, 0.61-0.71 at 32, before the tiles were trimmed; after,
0.49-1.06 at 64 and 0.60-1.11 at 128; at 4 real rows of a 16-row bucket the
kernel computes 4 rows where XLA computes 16).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from esurge.models.cpu_kernels import PANEL, coded_matmul_kernel, widened_matmul_kernel
from esurge.models.decoder_config import WIDENED_BITS
from esurge.models.packed_linear import DUAL_KERNEL_MAX_ROWS
from esurge.models.weight_codes import CODE_BLOCK, WeightCodes

__all__ = ["CodedGateUp", "CodedLinear", "code_bytes", "coded_or_plain", "pack_codes",
           "pack_gate_up_codes"]

_HALF = PANEL // 2


def code_bytes(bits: int) -> int:
    """Bytes per panel row: 4-bit codes two to a byte, 8-bit one."""
    return PANEL // 2 if bits == 4 else PANEL


def _columns(out_features: int) -> np.ndarray:
    """[P, PANEL]: the weight column each slot of pack_weight's panels holds (-1: padding)."""
    panels = -(-out_features // PANEL)
    columns = np.arange(panels * PANEL).reshape(panels, PANEL)
    return np.where(columns < out_features, columns, -1)


def _gate_up_columns(intermediate: int) -> np.ndarray:
    """[P, PANEL]: the same for pack_gate_up's panels (16 gate, then the same 16 up columns)."""
    panels = -(-intermediate // _HALF)
    gate = np.arange(panels * _HALF).reshape(panels, _HALF)
    real = gate < intermediate
    return np.concatenate([np.where(real, gate, -1), np.where(real, gate + intermediate, -1)],
                          axis=1)


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
    """A projection's codes ([out, in]) in the column panels of
    esurge.models.packed_linear.pack_weight."""
    return _panels(codes, _columns(codes.shape[0]))


def pack_gate_up_codes(codes: WeightCodes, intermediate: int) -> dict[str, np.ndarray]:
    """A fused gate/up weight's codes ([2I, in], gate rows first) in the SiLU
    panels of esurge.models.packed_linear.pack_gate_up."""
    return _panels(codes, _gate_up_columns(intermediate))


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
               silu_mul: bool, float32_out: bool = False
               ) -> jax.Array:  # [T, in] -> [T, out_features]
        return coded_matmul_kernel(x, self.codes[...], self.scale[...], self.offset[...],
                                   out_features, self.bits, num_rows, silu_mul=silu_mul,
                                   float32_out=float32_out)


class _WidenedPanels(nnx.Module):
    """One packed weight as a bfloat16 checkpoint's own values (WIDENED_BITS),
    multiplied in float32 (cpu_kernels/widened_matmul.cc)."""

    def __init__(self, in_features: int, panels: int):
        self.panels = nnx.Param(jnp.zeros((panels, in_features, PANEL), jnp.bfloat16))

    def matmul(self, x: jax.Array, out_features: int, num_rows: jax.Array | None,
               silu_mul: bool, float32_out: bool = False
               ) -> jax.Array:  # [T, in] -> [T, out_features]
        # float32 x: the results are float32 whatever float32_out says
        return widened_matmul_kernel(x, self.panels[...], out_features, num_rows,
                                     silu_mul=silu_mul)


def _weight_panels(in_features: int, panels: int, bits: int) -> _CodedPanels | _WidenedPanels:
    if bits == WIDENED_BITS:
        return _WidenedPanels(in_features, panels)
    return _CodedPanels(in_features, panels, bits)


def coded_or_plain(x: jax.Array,  # [T, in]
                   kernel: Callable[[], jax.Array], plain: Callable[[], jax.Array] | None
                   ) -> jax.Array:
    """The coded kernel's product or XLA's on the float32 weight (plain; None
    when the model keeps none), whichever serves a bucket of x's rows."""
    if plain is None or x.shape[0] <= DUAL_KERNEL_MAX_ROWS:
        return kernel()
    return plain()


class CodedLinear(nnx.Module):
    """y = x W + b with W as codes in column panels (dual: also input-major float32)."""

    def __init__(self, in_features: int, out_features: int, *, bits: int, bias: bool,
                 dtype: jnp.dtype, dual: bool = False):
        self.weight = _weight_panels(in_features, -(-out_features // PANEL), bits)
        self.plain = (nnx.Param(jnp.zeros((in_features, out_features), dtype)) if dual
                      else None)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.out_features = out_features

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None,
                 float32_out: bool = False) -> jax.Array:  # [T, in] -> [T, out]
        """float32_out: bfloat16 x gets the float32 sums, unrounded (logits)."""
        plain = self.plain
        y = coded_or_plain(
            x, lambda: self.weight.matmul(x, self.out_features, num_rows, False, float32_out),
            None if plain is None else lambda: x @ plain[...])
        return y if self.bias is None else y + self.bias[...]


class CodedGateUp(nnx.Module):
    """silu(x W_gate) * (x W_up) from codes in the SiLU panels (no biases)."""

    def __init__(self, in_features: int, intermediate: int, *, bits: int, dtype: jnp.dtype,
                 dual: bool = False):
        self.weight = _weight_panels(in_features, -(-intermediate // _HALF), bits)
        self.plain = (nnx.Param(jnp.zeros((in_features, 2 * intermediate), dtype)) if dual
                      else None)
        self.intermediate = intermediate

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, in] -> [T, intermediate]
        plain, half = self.plain, self.intermediate

        def through_plain() -> jax.Array:
            y = x @ plain[...]  # type: ignore[index]
            return jax.nn.silu(y[:, :half]) * y[:, half:]

        return coded_or_plain(x,
                              lambda: self.weight.matmul(x, half, num_rows, silu_mul=True),
                              None if plain is None else through_plain)
