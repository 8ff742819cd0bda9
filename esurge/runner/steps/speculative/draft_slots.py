"""Per-request slots on the device for what the head proposed: the drafts themselves
and, for sampled requests, their distributions (SpecDecoder.prob_buffer).

A speculative step's drafts go back to the engine as `DeviceDrafts`, handed
over once the step's verification is read, while the device may still be
drafting: the engine schedules the next step in the meantime, and that step
reads the drafts from `buffer` ([slots, k], the last slot a sink for
requests that did not draft), not from the host. A request keeps its slot
until it leaves the batch; the buffer's rows do not move when the runner's
batch rows do. A slot holds a request's latest proposal only: drafts from an
older one (a step whose proposals were not scheduled) are read to the host
instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from esurge.models.tensor_parallel import replicated
from esurge.outputs import DeviceDrafts
from esurge.runner.host_read import to_host
from esurge.runner.steps.speculative.verify import store_drafts

__all__ = ["DraftSlots", "ReadOnce"]


@dataclass(frozen=True, slots=True, eq=False)
class _Handle:
    """Where a request's drafts wait: a slot of one DraftSlots, while that slot
    holds the same proposal."""

    owner: DraftSlots
    slot: int
    generation: int


class ReadOnce:
    """One step's drafts [R, D], read to the host when the first value is asked for."""

    __slots__ = ("_array", "_host")

    def __init__(self, array: jax.Array) -> None:
        self._array = array
        self._host: np.ndarray | None = None

    def row(self, i: int) -> np.ndarray:
        """Request i's drafts (waits for the device the first time)."""
        if self._host is None:
            self._host = to_host(self._array)
        return self._host[i]


class DraftSlots:
    """Slots of max_rows requests (plus the sink) and the draft buffer they index."""

    def __init__(self, max_rows: int, num_spec: int, mesh: jax.sharding.Mesh | None) -> None:
        self.sink = max_rows
        self._free = list(range(max_rows - 1, -1, -1))
        self._of: dict[str, int] = {}
        self.buffer = replicated(jnp.zeros((max_rows + 1, num_spec), jnp.int32), mesh)
        self.generation = 0  # proposals kept so far
        self._kept: dict[int, int] = {}  # slot -> the proposal it holds

    def slot(self, req_id: str) -> int:
        """The request's slot, given it now if it has none."""
        slot = self._of.get(req_id)
        if slot is None:
            slot = self._of[req_id] = self._free.pop()
        return slot

    def slot_or_sink(self, req_id: str) -> int:
        """The request's slot, or the sink if it never had one."""
        return self._of.get(req_id, self.sink)

    def release(self, req_ids: Iterable[str]) -> None:
        """Free the slots of requests that left the batch."""
        for req_id in req_ids:
            slot = self._of.pop(req_id, None)
            if slot is not None:
                self._kept.pop(slot, None)
                self._free.append(slot)

    def keep(self, req_ids: Sequence[str], drafting: np.ndarray,
             drafts: jax.Array  # [R, D] int32: the proposal's rows, D <= k
             ) -> np.ndarray:
        """Store the drafting requests' proposals ([num_reqs] bool) in the buffer;
        returns every row's slot [R] (the sink for rows that did not draft)."""
        self.generation += 1
        slots = np.full(drafts.shape[0], self.sink, np.int32)
        for i in np.flatnonzero(drafting).tolist():
            slots[i] = slot = self.slot(req_ids[i])
            self._kept[slot] = self.generation
        self.buffer = store_drafts(self.buffer, slots, drafts)
        return slots

    def on_device(self, slot: int, generation: int, count: int, drafts: ReadOnce,
                  row: int) -> DeviceDrafts:
        """The first `count` drafts of a proposal kept at `slot` (`row` of its step)."""
        return DeviceDrafts(partial(drafts.row, row), count, _Handle(self, slot, generation))

    def device_slot(self, drafts: Sequence[int]) -> int | None:
        """The slot of drafts this buffer still holds (None: read their values)."""
        if not isinstance(drafts, DeviceDrafts):
            return None
        handle = drafts.handle
        if (isinstance(handle, _Handle) and handle.owner is self
                and self._kept.get(handle.slot) == handle.generation):
            return handle.slot
        return None
