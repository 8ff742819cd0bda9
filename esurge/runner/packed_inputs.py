"""One step's int32 inputs as one flat host buffer: a single host-to-device
transfer per step instead of one per array.

The runner builds the step's arrays with numpy (step_inputs.py), `pack_inputs`
lays them end to end in one int32 buffer, and the jitted model step cuts them
back out with `InputLayout.unpack` (static offsets: slicing is free inside the
program). One argument instead of nine; on the 2-core CPU the difference in
dispatch time was within the measurement noise (a few tens of microseconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import jax
import numpy as np

from esurge.models.batch import ForwardBatch

__all__ = ["InputLayout", "pack_inputs"]

# The ForwardBatch arrays carried, in buffer order (the optional tile arrays
# follow when the step tiles its queries).
_FIELDS = ("input_ids", "positions", "token_req", "slot_mapping", "page_tables",
           "query_start_loc", "seq_lens", "logits_indices")
_TILE_FIELDS = ("tile_rows", "row_in_tiles")


@dataclass(frozen=True, slots=True)
class InputLayout:
    """Where each array sits in the flat buffer; hashable, a static jit argument
    (one per bucket shape, so it adds no compiles)."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (field, shape) in buffer order
    query_tile: int

    @property
    def size(self) -> int:
        """Elements in the flat buffer."""
        return sum(prod(shape) for _, shape in self.shapes)

    @property
    def num_steps(self) -> int:
        """Decode iterations of the step (> 1: a burst carrying its later slots)."""
        for name, shape in self.shapes:
            if name == "burst_slot_mapping":
                return shape[0] + 1
        return 1

    def unpack(self, flat: jax.Array  # [size] int32
               ) -> tuple[ForwardBatch, jax.Array, jax.Array | None]:
        """(the step's ForwardBatch, prev_index [T], the burst's later slot
        mappings [num_steps - 1, G, T] or None) cut back out of the buffer."""
        parts: dict[str, jax.Array] = {}
        offset = 0
        for name, shape in self.shapes:
            n = prod(shape)
            parts[name] = flat[offset:offset + n].reshape(shape)
            offset += n
        prev_index = parts.pop("prev_index")
        burst_slots = parts.pop("burst_slot_mapping", None)
        return ForwardBatch(query_tile=self.query_tile, **parts), prev_index, burst_slots


def pack_inputs(batch: ForwardBatch, prev_index: np.ndarray,  # [T] int32
                burst_slots: np.ndarray | None = None,  # [K - 1, G, T] int32
                ) -> tuple[np.ndarray, InputLayout]:
    """The batch's arrays, prev_index and a burst's later slot mappings end to
    end in one int32 buffer, with the layout that unpacks them."""
    names = (*_FIELDS, *(_TILE_FIELDS if batch.tile_rows is not None else ()), "prev_index")
    arrays = [np.asarray(getattr(batch, name)) for name in names[:-1]] + [prev_index]
    if burst_slots is not None:
        names += ("burst_slot_mapping",)
        arrays.append(burst_slots)
    for name, arr in zip(names, arrays, strict=True):
        if arr.dtype != np.int32:
            raise ValueError(f"step input {name} must be int32, got {arr.dtype}")
    shapes = tuple((name, tuple(arr.shape)) for name, arr in zip(names, arrays, strict=True))
    flat = np.concatenate([arr.ravel() for arr in arrays])
    return flat, InputLayout(shapes, batch.query_tile)

