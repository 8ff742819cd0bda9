"""The runner's step builder gives the model the batch the model's contract describes.

The model tests build their batches from explicit chunks
(`esurge.models.build_forward_batch`); serving builds them from the
persistent batch and the scheduler's diffs (`build_step_inputs`). Here a real
scheduler runs mixed workloads (chunked prefill, prefix-cache hits,
preemption under a small page pool) and every step's production batch must
equal the chunk-built one for the same requests, array for array.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from esurge.models.batch import ForwardBatch, RequestChunk, build_forward_batch
from esurge.runner.buckets import StepBuckets
from esurge.runner.input_batch import InputBatch
from esurge.runner.step_inputs import StepInputs, build_step_inputs
from esurge.scheduler import Scheduler
from tests.scheduler.fakes import FakeRunner, make_request, make_scheduler

VOCAB, MAX_LEN, PAGE = 50, 64, 4
FIELDS = ("input_ids", "positions", "token_req", "slot_mapping", "page_tables",
          "query_start_loc", "seq_lens", "logits_indices")


def _chunk_batch(inputs: StepInputs, ib: InputBatch, runner: FakeRunner,
                 buckets: StepBuckets) -> ForwardBatch:
    """The same step from explicit chunks: each request's tokens this step, its
    pages; the requests padded to the plain model step's floor."""
    chunks = []
    for req_id, row, seq_len in zip(inputs.req_ids, inputs.rows.tolist(),
                                    inputs.seq_lens.tolist(), strict=True):
        start = int(ib.num_computed[row])
        state = runner.states[req_id]
        chunks.append(RequestChunk(state.tokens[start:seq_len], start, state.pages))
    return build_forward_batch(
        chunks, page_size=PAGE, num_groups=1, num_tokens_bucket=len(inputs.batch.input_ids),
        num_reqs_bucket=buckets.model_requests(inputs.num_reqs_bucket),
        max_pages_per_req=ib.page_tables.shape[2])


def _drive(scheduler: Scheduler, buckets: StepBuckets, max_steps: int = 400) -> int:
    """Run every request to its end, checking each step; returns the steps checked."""
    runner = FakeRunner(PAGE)
    ib = InputBatch(buckets.request_buckets[-1], MAX_LEN, 1, math.ceil(MAX_LEN / PAGE), VOCAB)
    checked = 0
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return checked
        out = scheduler.schedule()
        ib.apply(out)
        result = runner.execute(out)
        if not out.is_empty():
            inputs = build_step_inputs(ib, out, buckets, PAGE, {})
            want = _chunk_batch(inputs, ib, runner, buckets)
            for name in FIELDS:
                np.testing.assert_array_equal(getattr(inputs.batch, name), getattr(want, name),
                                              err_msg=name)
            tokens = np.zeros(buckets.request_buckets[-1], np.int32)
            for i, req_id in enumerate(inputs.req_ids):
                sampled = result.sampled_token_ids[result.req_id_to_index[req_id]]
                tokens[i] = sampled[0] if sampled else 0
            ib.record_sampled(inputs.req_ids, inputs.samples, inputs.seq_lens, tokens[None])
            checked += 1
        scheduler.update_from_output(out, result)
    raise AssertionError("requests still unfinished")


@pytest.mark.parametrize("seed", range(4))
def test_every_step_matches_the_chunk_built_batch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # A small pool forces preemption; shared prefixes hit the prefix cache.
    scheduler = make_scheduler(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=MAX_LEN,
                               page_size=PAGE, num_pages=14, chunked=True)
    prefix = rng.integers(1, VOCAB, 9).tolist()
    for i in range(10):
        own = rng.integers(1, VOCAB, int(rng.integers(1, 20))).tolist()
        prompt = (prefix + own) if i % 2 else own
        scheduler.add_request(make_request(f"r{i}", prompt, int(rng.integers(1, 24))))
    buckets = StepBuckets.create(24, 6, None, min_tokens=8)
    assert _drive(scheduler, buckets) > 40
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert scheduler.kv_cache_manager.num_free_pages == scheduler.kv_cache_manager.num_usable_pages


def test_rows_computed_again_write_to_the_null_page_and_keep_their_slots() -> None:
    # A request moved back to compute again (for its draft head) has those
    # tokens' keys and values in the cache already, maybe in pages the prefix
    # cache shares: its rows write to the null page, their real slots kept
    # beside for the head.
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=32, chunked=True,
                               max_model_len=MAX_LEN, page_size=PAGE, num_pages=20)
    scheduler.add_request(make_request("a", list(range(1, 11)), 8, ignore_eos=True))
    scheduler.add_request(make_request("b", list(range(20, 26)), 8, ignore_eos=True))
    buckets = StepBuckets.create(32, 2, None, min_tokens=8)
    runner = FakeRunner(PAGE)
    ib = InputBatch(2, MAX_LEN, 1, math.ceil(MAX_LEN / PAGE), VOCAB)
    for _ in range(3):  # the prompts, then two decode steps
        out = scheduler.schedule()
        ib.apply(out)
        result = runner.execute(out)
        inputs = build_step_inputs(ib, out, buckets, PAGE, {})
        tokens = np.array([[result.sampled_token_ids[result.req_id_to_index[r]][0]
                            for r in inputs.req_ids]], np.int32)
        ib.record_sampled(inputs.req_ids, inputs.samples, inputs.seq_lens, tokens)
        scheduler.update_from_output(out, result)
    until = scheduler.requests["a"].num_computed_tokens  # the prompt and two outputs
    assert scheduler.rewind({"a": 4}) == {"a": until} and until == 12
    out = scheduler.schedule()
    ib.apply(out)
    plain = build_step_inputs(ib, out, buckets, PAGE, {})
    again = build_step_inputs(ib, out, buckets, PAGE, {}, recompute={"a": until})
    assert again.kept_slots is not None and plain.kept_slots is None
    rows = np.flatnonzero(np.asarray(plain.batch.token_req) == 0)[:out.num_scheduled_tokens["a"]]
    positions = np.asarray(plain.batch.positions)[rows]
    assert positions.tolist() == list(range(4, until + 1))
    redone = rows[positions < until]
    slots = np.asarray(plain.batch.slot_mapping)
    assert (np.asarray(again.batch.slot_mapping)[:, redone] == 0).all()  # the null page
    np.testing.assert_array_equal(again.kept_slots[:, redone], slots[:, redone])
    # The new token's row, and b's rows, write where they always did.
    kept = np.ones(slots.shape[1], bool)
    kept[redone] = False
    np.testing.assert_array_equal(np.asarray(again.batch.slot_mapping)[:, kept],
                                  slots[:, kept])
    assert (again.kept_slots[:, kept] == -1).all()
