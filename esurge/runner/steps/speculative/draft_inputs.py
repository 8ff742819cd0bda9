"""A speculative step's host-side inputs: the drafts it verifies and the
proposer's arrays, aligned with the target step's (T, R) bucket."""

from __future__ import annotations

import jax
import numpy as np

from esurge.runner.device_step import FollowInputs
from esurge.runner.input_batch import InputBatch
from esurge.runner.sampler import SamplingTensors
from esurge.runner.step_inputs import StepInputs
from esurge.runner.steps.speculative.draft_slots import DraftSlots
from esurge.spec_decode.proposer import DraftBatch

__all__ = ["allowed_count", "draft_inputs", "follow_inputs", "scheduled_drafts"]


def scheduled_drafts(ib: InputBatch, inputs: StepInputs, k: int, slots: DraftSlots
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(drafts [R, k], their counts [R], draft-probability slots [R]) to verify:
    the ids of drafts that are not on the device come from the batch's tokens."""
    r_bucket = inputs.num_reqs_bucket
    drafts = np.zeros((r_bucket, k), np.int32)
    num_drafts = np.zeros(r_bucket, np.int32)
    prob_slots = np.full(r_bucket, slots.sink, np.int32)
    on_device = inputs.draft_slots
    for i in np.flatnonzero(inputs.num_drafts).tolist():
        nd = int(inputs.num_drafts[i])
        num_drafts[i] = nd
        prob_slots[i] = slots.slot_or_sink(inputs.req_ids[i])
        if on_device is not None and on_device[i] >= 0:
            continue  # verification reads them from the draft buffer
        row, start = int(inputs.rows[i]), int(inputs.seq_lens[i]) - nd
        drafts[i, :nd] = ib.token_ids[row, start:start + nd]
    return drafts, num_drafts, prob_slots


def draft_inputs(ib: InputBatch, inputs: StepInputs, tensors: SamplingTensors, group: int,
                 unsynced_ids: set[str], run_positions: jax.Array,  # [T] int32
                 run_slots: jax.Array,  # [T] int32
                 ) -> tuple[DraftBatch, np.ndarray]:
    """The proposer's arrays for this step (`DraftBatch`), and which requests
    may draft ([num_reqs] bool): not those with per-token sampling state
    (dense), nor those whose drafts stopped (`unsynced_ids`). run_positions
    and run_slots (the draft group's) are as the target ran them
    (model_step_features): the head writes its cache there, which the host may
    not know yet."""
    batch, total = inputs.batch, inputs.num_tokens
    num_reqs, r_bucket = len(inputs.req_ids), inputs.num_reqs_bucket
    t_bucket = len(batch.input_ids)
    positions = np.asarray(batch.positions[:total], np.int64)
    token_req = np.asarray(batch.token_req[:total], np.int64)
    rows = inputs.rows[token_req]
    following = positions + 1
    known = following < ib.num_known[rows]
    next_ids = np.zeros(t_bucket, np.int32)
    next_ids[:total][known] = ib.token_ids[rows[known], following[known]]
    ends = np.asarray(batch.query_start_loc[1:num_reqs + 1], np.int64)
    first_row = np.zeros(r_bucket, np.int32)
    first_row[:num_reqs] = ends - 1 - inputs.num_drafts
    offset = np.arange(total) - first_row[token_req]
    emitted = inputs.samples[token_req] & (offset >= 0)
    next_slot = np.full(t_bucket, -1, np.int32)
    next_slot[:total][emitted] = offset[emitted]
    dense = np.fromiter((ib.sampling.dense[r] is not None for r in inputs.rows.tolist()),
                        bool, num_reqs)
    unsynced = np.fromiter((r in unsynced_ids for r in inputs.req_ids), bool, num_reqs)
    eligible = inputs.samples & ~dense & ~unsynced
    propose_mask = np.zeros(r_bucket, bool)
    propose_mask[:num_reqs] = eligible
    draft_batch = DraftBatch(
        positions=run_positions, token_req=batch.token_req,
        slot_mapping=run_slots, page_tables=batch.page_tables[group],
        # The batch's real rows (the step's tokens; more in calibrate's timing steps).
        num_tokens=np.int32(batch.query_start_loc[-1]), next_ids=next_ids,
        next_slot=next_slot,
        first_row=first_row, propose=propose_mask,
        temperature=np.asarray(tensors.temperature, np.float32))
    return draft_batch, eligible


def allowed_count(ib: InputBatch, row: int, num_tokens: int, count: int) -> int:
    """How many of a request's `count` drafts could still be emitted once it
    holds num_tokens tokens (prompt included): none past max_tokens or
    max_model_len."""
    limit = count
    max_tokens = ib.params[row].max_tokens
    if max_tokens is not None:
        limit = min(limit, max_tokens - (num_tokens - int(ib.num_prompt[row])) - 1)
    limit = min(limit, ib.max_model_len - num_tokens - 1)
    return max(limit, 0)


def follow_inputs(inputs: StepInputs, last_tokens: jax.Array,  # [M] int32
                  rejected: jax.Array,  # [M] int32
                  ) -> FollowInputs:
    """Where this step's requests of the speculative step in flight start, from
    the last verification's last tokens and rejected drafts by row (that step's:
    it was the last one verified); nothing moves where no request follows one."""
    index, src = inputs.follow_index, inputs.follow_src
    return FollowInputs(
        index=np.full(len(inputs.batch.input_ids), -1, np.int32) if index is None else index,
        src=np.full(len(inputs.batch.seq_lens), -1, np.int32) if src is None else src,
        last_tokens=last_tokens, rejected=rejected)
