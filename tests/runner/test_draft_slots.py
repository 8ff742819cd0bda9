"""Drafts kept on the device between a speculative step and the next: which
handles the next step may read there, and what everyone else reads."""

from __future__ import annotations

import pickle

import jax.numpy as jnp
import numpy as np
import pytest

from esurge.outputs import DeviceDrafts
from esurge.runner.steps.speculative.draft_slots import DraftSlots, ReadOnce

K = 3


def _proposal(slots: DraftSlots, req_ids: list[str], rows: list[list[int]]
              ) -> list[DeviceDrafts]:
    drafts = jnp.asarray(rows, jnp.int32)
    kept = slots.keep(req_ids, np.ones(len(req_ids), bool), drafts)
    read = ReadOnce(drafts)
    return [slots.on_device(int(kept[i]), slots.generation, K, read, i)
            for i in range(len(req_ids))]


def test_the_latest_proposal_is_read_on_the_device_and_an_older_one_on_the_host() -> None:
    slots = DraftSlots(max_rows=4, num_spec=K, mesh=None)
    old_a, b = _proposal(slots, ["a", "b"], [[1, 2, 3], [4, 5, 6]])
    (new_a,) = _proposal(slots, ["a"], [[7, 8, 9]])
    slot_a = slots.device_slot(new_a)
    assert slot_a is not None and slots.device_slot(b) is not None
    assert slots.device_slot(old_a) is None  # its slot holds a newer proposal now
    assert np.asarray(slots.buffer)[slot_a].tolist() == [7, 8, 9]
    assert slots.device_slot(new_a[:2]) == slot_a  # a prefix stays on the device
    slots.release(["a"])
    assert slots.device_slot(new_a) is None
    other = DraftSlots(max_rows=4, num_spec=K, mesh=None)
    assert other.device_slot(b) is None and other.device_slot([4, 5, 6]) is None


def test_device_drafts_read_their_values_only_when_asked_and_travel_as_lists() -> None:
    reads = []

    def read() -> np.ndarray:
        reads.append(1)
        return np.array([4, 5, 6, 0])

    drafts = DeviceDrafts(read, 3, handle=None)
    assert len(drafts) == 3 and bool(drafts) and reads == []
    assert len(drafts[:2]) == 2 and reads == []
    assert len(drafts[:7]) == 3 and len(drafts[:0]) == 0 and reads == []
    assert list(drafts) == [4, 5, 6] and drafts[1:] == [5, 6] and drafts[-1] == 6
    assert drafts == [4, 5, 6] and drafts[:2] == (4, 5)
    assert pickle.loads(pickle.dumps(drafts)) == [4, 5, 6]
    assert type(pickle.loads(pickle.dumps(drafts))) is list
    with pytest.raises(ValueError):
        DeviceDrafts(read, -1, handle=None)
