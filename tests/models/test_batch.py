"""The host-side ForwardBatch builder: exact layout and refusals."""

from __future__ import annotations

import numpy as np
import pytest

from esurge.models import RequestChunk, build_forward_batch

SHAPE = {"page_size": 4, "num_groups": 2, "num_tokens_bucket": 8, "num_reqs_bucket": 3,
         "max_pages_per_req": 4}


def test_layout_of_a_mixed_step() -> None:
    batch = build_forward_batch([
        RequestChunk([11, 12, 13], 2, [[5, 9], [7, 3]], num_logits=0),  # prefill chunk
        RequestChunk([21], 6, [[0, 8], [4, 6]]),  # decode; group 0 freed page 0 (window)
        RequestChunk([31, 32], 0, [[2], [1]], num_logits=2),  # verify 1 draft
    ], **SHAPE, num_logits_bucket=4)
    np.testing.assert_array_equal(batch.input_ids, [11, 12, 13, 21, 31, 32, 0, 0])
    np.testing.assert_array_equal(batch.positions, [2, 3, 4, 6, 0, 1, 0, 0])
    np.testing.assert_array_equal(batch.token_req, [0, 0, 0, 1, 2, 2, 0, 0])
    np.testing.assert_array_equal(batch.slot_mapping, [
        [22, 23, 36, 34, 8, 9, 0, 0],
        [30, 31, 12, 26, 4, 5, 0, 0],
    ])
    np.testing.assert_array_equal(batch.page_tables[0], [[5, 9, 0, 0], [0, 8, 0, 0], [2, 0, 0, 0]])
    np.testing.assert_array_equal(batch.query_start_loc, [0, 3, 4, 6])
    np.testing.assert_array_equal(batch.seq_lens, [5, 7, 2])
    np.testing.assert_array_equal(batch.logits_indices, [3, 4, 5, 0])
    assert int(batch.num_tokens) == 6
    assert {a.dtype for a in (batch.input_ids, batch.slot_mapping, batch.page_tables)} == {
        np.dtype(np.int32)}


def test_padded_requests_repeat_the_token_count() -> None:
    batch = build_forward_batch([RequestChunk([1], 0, [[3], [4]])], **SHAPE)
    np.testing.assert_array_equal(batch.query_start_loc, [0, 1, 1, 1])
    np.testing.assert_array_equal(batch.seq_lens, [1, 0, 0])


@pytest.mark.parametrize(("chunks", "message"), [
    ([RequestChunk(list(range(9)), 0, [[1, 2, 3], [4, 5, 6]])],
     "num_tokens bucket 8 is too small for 9"),
    ([RequestChunk([1], 0, [[1], [2]])] * 4, "num_reqs bucket 3 is too small for 4"),
    ([RequestChunk([1, 2], 3, [[1], [2]])],
     "request 0 group 0 needs page 1 for position 4 but its page table has 1 entries"),
    ([RequestChunk([1], 4, [[1, 2], [3, 0]])],
     "request 0 group 1 would write into the null page 0"),
    ([RequestChunk([1], 0, [[1, 2, 3, 4, 5], [1]])],
     "request 0 group 0 has 5 pages, more than max_pages_per_req=4"),
    ([RequestChunk([1], 0, [[1]])], "request 0 has 1 page tables for 2 groups"),
])
def test_inconsistent_steps_are_refused(chunks: list[RequestChunk], message: str) -> None:
    with pytest.raises(ValueError) as err:
        build_forward_batch(chunks, **SHAPE)
    assert str(err.value) == message


def test_page_ids_beyond_the_pool_are_refused() -> None:
    with pytest.raises(ValueError) as err:
        build_forward_batch([RequestChunk([1], 0, [[12], [1]])], **SHAPE, num_pages=12)
    assert str(err.value) == "request 0 group 0 page ids must lie in [0, 12)"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"token_ids": [], "start_position": 0}, "token_ids must hold at least one token"),
    ({"token_ids": [1], "start_position": -1}, "start_position must be an int >= 0, got -1"),
    ({"token_ids": [1], "start_position": 0, "num_logits": 2},
     "num_logits must be in [0, 1], got 2"),
])
def test_bad_chunks_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        RequestChunk(page_tables=[[1]], **kwargs)  # type: ignore[arg-type]
    assert str(err.value) == message
