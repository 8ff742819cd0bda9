"""GGUF block formats as affine codes: w = scale * code + offset per 32 inputs.

Most of llama.cpp's formats store, for every block of 32 consecutive inputs
of one output row, small integer codes and one or two float16 constants.
Rewritten as an integer `code` with a float32 `scale` and `offset` per
32-input block, every one of the formats below dequantizes as
`scale * code + offset` with the same float32 arithmetic the gguf package's
numpy dequantizers do: scale * code is exact in float32 (a float16, or a
float16 times a 6-bit integer, times at most 8 bits), so the one rounding is
the addition, as in gguf's `d * q + m` (or `d * q`, where the offset is zero
or, for Q4_0, the exact -8 d). Keeping the codes lets the CPU kernel stream a
sixth of a float32 weight's bytes and still compute on exactly the values
transformers dequantizes (esurge/models/cpu_kernels/coded_matmul.cc).

Formats with 16-input sub-blocks (Q6_K, Q2_K, Q3_K) or non-affine codes
(the IQ family) have no such form here; their tensors serve as float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["CODED_TYPES", "CODE_BLOCK", "WeightCodes", "concat_rows", "weight_codes"]

CODE_BLOCK = 32  # inputs per scale and offset


@dataclass(frozen=True, slots=True)
class WeightCodes:
    """A weight [out, in] as codes: w[o, i] = scale[o, i // 32] * codes[o, i] + offset[o, i // 32].

    bits 4: codes are unsigned, 0..15 (uint8); bits 8: signed, -128..127 (int8).
    """

    codes: np.ndarray  # [out, in] uint8 (bits 4) or int8 (bits 8)
    scale: np.ndarray  # [out, in // 32] float32
    offset: np.ndarray  # [out, in // 32] float32
    bits: int

    def __post_init__(self) -> None:
        out, inputs = self.codes.shape
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if inputs % CODE_BLOCK or self.scale.shape != (out, inputs // CODE_BLOCK):
            raise ValueError(f"codes {self.codes.shape} and scale {self.scale.shape} do not "
                             f"form blocks of {CODE_BLOCK}")
        if self.offset.shape != self.scale.shape:
            raise ValueError(f"offset {self.offset.shape} != scale {self.scale.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in)."""
        return self.codes.shape  # type: ignore[return-value]

    def take_rows(self, rows: np.ndarray) -> WeightCodes:  # rows: [out] int
        """The same weight with its output rows reordered."""
        return WeightCodes(self.codes[rows], self.scale[rows], self.offset[rows], self.bits)

    def dequantize(self) -> np.ndarray:  # [out, in] float32
        """The float32 weight the codes stand for (the kernel's arithmetic)."""
        scale = np.repeat(self.scale, CODE_BLOCK, axis=1)
        offset = np.repeat(self.offset, CODE_BLOCK, axis=1)
        return scale * self.codes.astype(np.float32) + offset


def concat_rows(parts: list[WeightCodes]) -> WeightCodes | None:
    """Weights stacked along the output axis; None when their code widths differ."""
    if len({p.bits for p in parts}) != 1:
        return None
    return WeightCodes(np.concatenate([p.codes for p in parts]),
                       np.concatenate([p.scale for p in parts]),
                       np.concatenate([p.offset for p in parts]), parts[0].bits)


# A decoder: gguf blocks [n, bytes] -> (codes [n, block], scale, offset [n, block // 32], bits).
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, int]


def _f16(raw: np.ndarray) -> np.ndarray:  # [n, 2] uint8 -> [n, 1] float32
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, bytes] -> [n, 2 * bytes] codes: each run of `group` bytes gives its
    low nibbles, then its high nibbles (llama.cpp's order)."""
    n = qs.shape[0]
    split = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (split & np.uint8(15)).reshape(n, -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:  # [n, 4] uint8 -> [n, 32] uint8: bit j of qh
    bits = qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _q4_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:], 16), d, -8 * d, 4


def _q4_1(blocks: np.ndarray) -> _Decoded:
    return _nibbles(blocks[:, 4:], 16), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 4


def _q5_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 6:], 16) | (_high_bits(blocks[:, 2:6]) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), d, np.zeros_like(d), 8


def _q5_1(blocks: np.ndarray) -> _Decoded:
    q = _nibbles(blocks[:, 8:], 16) | (_high_bits(blocks[:, 4:8]) << np.uint8(4))
    return q.astype(np.int8), _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), 8


def _q8_0(blocks: np.ndarray) -> _Decoded:
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].copy().view(np.int8), d, np.zeros_like(d), 8


def _q4_k(blocks: np.ndarray) -> _Decoded:
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:4 + Q4_K.K_SCALE_SIZE])
    scale = d * sc.astype(np.float32)
    offset = -(dmin * m.astype(np.float32))
    return _nibbles(blocks[:, 4 + Q4_K.K_SCALE_SIZE:], 32), scale, offset, 4


_DECODERS: dict[str, Callable[[np.ndarray], _Decoded]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
}
CODED_TYPES: tuple[str, ...] = tuple(_DECODERS)


def weight_codes(data: np.ndarray, kind: str, shape: tuple[int, int]) -> WeightCodes | None:
    """The codes of a GGUF tensor of ggml type `kind` (its raw bytes, [out, in]
    elements); None for a type with no affine form."""
    decode = _DECODERS.get(kind)
    if decode is None:
        return None
    import gguf

    out, inputs = shape
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    codes, scale, offset, bits = decode(np.ascontiguousarray(data).reshape(-1, block_bytes))
    return WeightCodes(np.ascontiguousarray(codes.reshape(out, inputs)),
                       np.ascontiguousarray(scale.reshape(out, inputs // CODE_BLOCK),
                                            dtype=np.float32),
                       np.ascontiguousarray(offset.reshape(out, inputs // CODE_BLOCK),
                                            dtype=np.float32), bits)
