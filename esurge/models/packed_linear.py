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

bfloat16 panels keep the same shape with each panel's input rows interleaved
in pairs ([K, PANEL] stored as [K / 2, PANEL, 2]), the operand layout of the
CPU's bfloat16 dot products (AMX, AVX512_BF16; cpu_kernels/bf16_matmul.cc).
Column and row shards of the panels cut between pairs, so tensor parallelism
lays them out as it does float32 panels; the einsum path undoes the pairing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from esurge.models.cpu_kernels import PANEL, kernels_serve, packed_matmul_kernel
from esurge.models.local_shards import Split, over_local_panels

__all__ = ["PANEL", "PackedGateUp", "PackedLinear", "num_panels", "pack_gate_up", "pack_weight",
           "packed_matmul", "packed_silu_mul"]

_HALF = PANEL // 2  # gate (or up) columns per panel of a PackedGateUp


def num_panels(out_features: int) -> int:
    """Panels that hold out_features columns."""
    return -(-out_features // PANEL)


def _pairs_interleaved(dtype: jnp.dtype) -> bool:
    return jnp.dtype(dtype) == jnp.bfloat16


def _pair_rows(panels: jax.Array) -> jax.Array:  # [P, K, PANEL], same shape
    """Each panel's input rows 2j and 2j + 1 interleaved column by column."""
    p, k, n = panels.shape
    if k % 2:
        raise ValueError(f"bfloat16 panels need an even input width, got {k}")
    return panels.reshape(p, k // 2, 2, n).transpose(0, 1, 3, 2).reshape(p, k, n)


def _unpair_rows(panels: jax.Array) -> jax.Array:  # [P, K, PANEL], same shape
    """The inverse of _pair_rows: plain [K, PANEL] panels."""
    p, k, n = panels.shape
    return panels.reshape(p, k // 2, n, 2).transpose(0, 1, 3, 2).reshape(p, k, n)


def _plain_panels(packed: jax.Array) -> jax.Array:  # [P, K, PANEL]
    return _unpair_rows(packed) if _pairs_interleaved(packed.dtype) else packed


def _finish_packing(panels: jax.Array) -> jax.Array:  # [P, K, PANEL]
    return _pair_rows(panels) if _pairs_interleaved(panels.dtype) else panels


def pack_weight(weight: jax.Array) -> jax.Array:  # [in, out] -> [P, in, PANEL]
    """The packed form of an input-major weight (padding columns are zero;
    bfloat16 input rows paired, see the module docstring)."""
    k, n = weight.shape
    padded = jnp.pad(weight, ((0, 0), (0, num_panels(n) * PANEL - n)))
    return _finish_packing(padded.reshape(k, -1, PANEL).transpose(1, 0, 2))


# Most rows (a bucket's, known when tracing) the kernel serves when the
# model also keeps the input-major weight (DecoderConfig.dual_layout, chosen
# where the CPU lacks AVX-512): there the kernel's row tiles are at most 6
# rows, and past a hundred or so rows XLA's matmul on the plain [in, out]
# weight catches up, first on the SiLU-gated gate/up. `bench/kernel_rows.py`
# on a 2-core AMD EPYC with AVX2 only (kernel / XLA time, 4-bit codes for
# SmolLM2, float32 panels for the others): SmolLM2's projections 0.49-1.06 at
# 64 rows and 0.60-1.11 at 128 (a whole layer 0.80 / 0.90), the 150M Llama's
# 0.81-1.07 / 0.92-1.08, the 4.5M test model's 0.52-0.81 / 0.54-0.83; and the
# kernel computes only a bucket's real rows where XLA computes them all. It
# was 32 until the tiles' instruction stream was trimmed (panel_tiles.h):
# SmolLM2's prefill of a 40 / 100 / 120-token prompt (buckets 64 and 128)
# then took 113 / 204 / 208 ms, now 65-73 / 155-169 / 184-199.
DUAL_KERNEL_MAX_ROWS = 128


def _kernel_takes(x: jax.Array, packed: jax.Array) -> bool:
    """True when a CPU kernel multiplies these operands (float32, or bfloat16 natively)."""
    return x.dtype == packed.dtype and kernels_serve(x.dtype)


def _plain_takes(x: jax.Array, plain: nnx.Param[jax.Array] | None) -> bool:
    """True when a dual-layout module should run this bucket on its plain weight."""
    return plain is not None and x.shape[0] > DUAL_KERNEL_MAX_ROWS


def _unpad_shards(y: jax.Array, shards: int, out_features: int) -> jax.Array:
    """[T, shards * W] of per-shard padded columns -> [T, out_features]."""
    local = out_features // shards
    return y.reshape(y.shape[0], shards, -1)[:, :, :local].reshape(y.shape[0], out_features)


def packed_matmul(
    x: jax.Array,  # [T, in]
    packed: jax.Array,  # [P, in, PANEL]
    out_features: int,
    num_rows: jax.Array | None = None,  # [] int32: real rows; the rest is padding
    split: Split = Split.NONE,
    shards: int = 1,  # COLUMN: the shards the panels were packed for (pack_layer)
    float32_out: bool = False,  # bfloat16 x: the float32 sums, unrounded (logits)
) -> jax.Array:  # [T, out_features] x's dtype, or float32
    """x @ W for a packed W: the CPU kernel of its dtype where one serves, else XLA.

    Rows at or past num_rows are padding: the kernel returns zeros for them
    without computing them; the XLA path computes them like the others.
    Under a tensor-parallel mesh the kernel runs on each device's panels
    (esurge.models.local_shards.over_local_panels).
    """
    per_shard = split is Split.COLUMN and shards > 1
    if _kernel_takes(x, packed):
        rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32)
        local = out_features // shards if per_shard else out_features
        # A row-parallel shard's partial sum stays float32 until the shards are added.
        unrounded = float32_out or split is Split.ROW
        sharded = over_local_panels(
            lambda xs, ws, n: packed_matmul_kernel(xs, ws, local, n, float32_out=unrounded),
            split)
        if sharded is not None:
            return sharded(x, packed, rows)
        if per_shard:  # no mesh: the whole weight, each shard's padding dropped
            whole = packed_matmul_kernel(x, packed, packed.shape[0] * PANEL, rows,
                                         float32_out=float32_out)
            return _unpad_shards(whole, shards, out_features)
        return packed_matmul_kernel(x, packed, out_features, rows, float32_out=float32_out)
    y = jnp.einsum("tk,pkn->tpn", x, _plain_panels(packed),
                   preferred_element_type=jnp.float32 if float32_out else None
                   ).reshape(x.shape[0], -1)
    return _unpad_shards(y, shards, out_features) if per_shard else y[:, :out_features]


def pack_gate_up(weight: jax.Array, intermediate: int) -> jax.Array:  # [in, 2I] -> [P, in, PANEL]
    """A fused gate/up weight (gate columns first) packed for the SiLU epilogue:
    panel p holds gate columns [16p, 16p + 16) then the same up columns."""
    k = weight.shape[0]
    p = -(-intermediate // _HALF)
    halves = [jnp.pad(part, ((0, 0), (0, p * _HALF - intermediate))).reshape(k, p, _HALF)
              for part in (weight[:, :intermediate], weight[:, intermediate:])]
    return _finish_packing(jnp.concatenate(halves, axis=-1).transpose(1, 0, 2))


def packed_silu_mul(
    x: jax.Array,  # [T, in]
    packed: jax.Array,  # [P, in, PANEL] from pack_gate_up (per shard when shards > 1)
    intermediate: int,
    num_rows: jax.Array | None = None,  # [] int32: real rows; the rest is padding
    shards: int = 1,
) -> jax.Array:  # [T, intermediate]
    """silu(x @ W_gate) * (x @ W_up), the activation applied in the kernel's epilogue
    (so the [T, 2I] product is never written); XLA elsewhere. Column-parallel
    when shards > 1 (each shard's gate/up columns packed on their own)."""
    if _kernel_takes(x, packed):
        rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32)
        local = intermediate // shards
        sharded = over_local_panels(
            lambda xs, ws, n: packed_matmul_kernel(xs, ws, local, n, silu_mul=True),
            Split.COLUMN if shards > 1 else Split.NONE)
        if sharded is not None:
            return sharded(x, packed, rows)
        whole = packed_matmul_kernel(x, packed, packed.shape[0] * _HALF if shards > 1
                                     else intermediate, rows, silu_mul=True)
        return _unpad_shards(whole, shards, intermediate) if shards > 1 else whole
    y = jnp.einsum("tk,pkn->tpn", x, _plain_panels(packed))
    gate = y[..., :_HALF].reshape(x.shape[0], -1)
    up = y[..., _HALF:].reshape(x.shape[0], -1)
    if shards > 1:
        gate, up = _unpad_shards(gate, shards, intermediate), _unpad_shards(up, shards,
                                                                            intermediate)
    else:
        gate, up = gate[:, :intermediate], up[:, :intermediate]
    return jax.nn.silu(gate) * up


class PackedGateUp(nnx.Module):
    """silu(x W_gate) * (x W_up) with both weights packed by pack_gate_up (no biases).

    dual: also keep the fused input-major weight [in, 2I] (`plain`, gate
    columns first) for buckets past DUAL_KERNEL_MAX_ROWS.
    """

    def __init__(self, in_features: int, intermediate: int, *, dtype: jnp.dtype,
                 dual: bool = False, shards: int = 1):
        panels = shards * -(-(intermediate // shards) // _HALF)
        self.weight = nnx.Param(jnp.zeros((panels, in_features, PANEL), dtype))
        self.plain = (nnx.Param(jnp.zeros((in_features, 2 * intermediate), dtype)) if dual
                      else None)
        self.intermediate = intermediate
        self.shards = shards

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None
                 ) -> jax.Array:  # [T, in] -> [T, intermediate]
        if _plain_takes(x, self.plain):
            # The fused weight's columns are per shard: [gate_i | up_i].
            y = (x @ self.plain[...]).reshape(x.shape[0], self.shards, -1)  # type: ignore[index]
            local = self.intermediate // self.shards
            gated = jax.nn.silu(y[..., :local]) * y[..., local:]
            return gated.reshape(x.shape[0], self.intermediate)
        return packed_silu_mul(x, self.weight[...], self.intermediate, num_rows, self.shards)


class PackedLinear(nnx.Module):
    """y = x W + b with W stored packed, [P, in_features, PANEL].

    dual: also keep W input-major, [in_features, out_features] (`plain`), for
    buckets past DUAL_KERNEL_MAX_ROWS.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype,
                 dual: bool = False, split: Split = Split.NONE, shards: int = 1):
        shards = shards if split is Split.COLUMN else 1
        panels = shards * num_panels(out_features // shards)
        self.weight = nnx.Param(jnp.zeros((panels, in_features, PANEL), dtype))
        self.split = split
        self.shards = shards
        self.plain = (nnx.Param(jnp.zeros((in_features, out_features), dtype)) if dual
                      else None)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None
        self.out_features = out_features

    def __call__(self, x: jax.Array, num_rows: jax.Array | None = None,
                 float32_out: bool = False) -> jax.Array:  # [T, in] -> [T, out]
        """float32_out: bfloat16 x gets the float32 sums, unrounded (logits)."""
        if _plain_takes(x, self.plain):
            y = jnp.matmul(x, self.plain[...],  # type: ignore[index]
                           preferred_element_type=jnp.float32 if float32_out else None)
        else:
            y = packed_matmul(x, self.weight[...], self.out_features, num_rows, self.split,
                              self.shards, float32_out)
        if self.bias is not None:
            y = y + self.bias[...]
        return y
