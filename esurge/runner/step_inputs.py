"""Builds one step's padded inputs from the persistent batch, with numpy only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from esurge.models.batch import ForwardBatch
from esurge.models.kv_cache import NULL_PAGE
from esurge.runner.buckets import StepBuckets
from esurge.runner.input_batch import InputBatch
from esurge.scheduler.output import SchedulerOutput

__all__ = ["StepInputs", "build_step_inputs"]


@dataclass(slots=True)
class StepInputs:
    """Host arrays for one step plus what is needed to read its results.

    rows[i] is the batch row of scheduled request i (requests are ordered by
    row). samples[i] tells whether request i samples a token this step (its
    scheduled tokens reach the end of its known sequence); sample_positions[i]
    is that token's index in the request's output. prev_index[t] >= 0 means
    token t's id is the previous step's sampled token at that index (async
    scheduling), not yet on the host.
    """

    batch: ForwardBatch
    req_ids: list[str]
    rows: np.ndarray  # [R] int64
    samples: np.ndarray  # [R] bool
    sample_positions: np.ndarray  # [R] int32
    seq_lens: np.ndarray  # [R] int32
    prev_index: np.ndarray  # [T_bucket] int32
    num_tokens: int
    num_reqs_bucket: int


def build_step_inputs(ib: InputBatch, so: SchedulerOutput, buckets: StepBuckets, page_size: int,
                      prev_sample_index: dict[str, int]) -> StepInputs:
    """Flatten the scheduled requests into bucket-padded ForwardBatch arrays.

    prev_sample_index maps a request to its sampler row in the step still in
    flight, for tokens whose ids are not on the host yet.
    """
    sched = sorted(so.num_scheduled_tokens, key=ib.row_of.__getitem__)
    rows = np.fromiter((ib.row_of[r] for r in sched), np.int64, len(sched))
    n_sched = np.fromiter((so.num_scheduled_tokens[r] for r in sched), np.int64, len(sched))
    num_reqs, total = len(sched), int(n_sched.sum())
    t_bucket, r_bucket = buckets.tokens_for(total), buckets.requests_for(num_reqs)
    ends = np.cumsum(n_sched)
    starts = ends - n_sched
    req_of_token = np.repeat(np.arange(num_reqs), n_sched)
    positions = ib.num_computed[rows][req_of_token] + (np.arange(total) - starts[req_of_token])
    token_rows = rows[req_of_token]
    ids = ib.token_ids[token_rows, positions]
    unknown = positions >= ib.num_known[token_rows]
    prev_index = np.full(t_bucket, -1, np.int32)
    if unknown.any():
        prev_index[:total][unknown] = [prev_sample_index[sched[i]]
                                       for i in req_of_token[unknown].tolist()]
    seq_lens = (ib.num_computed[rows] + n_sched).astype(np.int32)
    samples = seq_lens >= ib.num_known[rows]
    page_tables = ib.page_tables[:, rows, :]  # [G, R, P]
    logical = positions // page_size
    slot = page_tables[:, req_of_token, logical] * page_size + positions % page_size

    def pad(arr: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
        out = np.full((*arr.shape[:-1], size), fill, np.int32)
        out[..., :arr.shape[-1]] = arr
        return out

    tables = np.full((page_tables.shape[0], r_bucket, page_tables.shape[2]), NULL_PAGE, np.int32)
    tables[:, :num_reqs] = page_tables
    qsl = np.full(r_bucket + 1, total, np.int32)
    qsl[:num_reqs] = starts
    batch = ForwardBatch(
        input_ids=pad(ids, t_bucket), positions=pad(positions, t_bucket),
        token_req=pad(req_of_token, t_bucket), slot_mapping=pad(slot, t_bucket, NULL_PAGE),
        page_tables=tables, query_start_loc=qsl, seq_lens=pad(seq_lens, r_bucket),
        logits_indices=pad(ends - 1, r_bucket),
    )
    return StepInputs(
        batch=batch, req_ids=sched, rows=rows, samples=samples,
        sample_positions=(seq_lens - ib.num_prompt[rows]).astype(np.int32), seq_lens=seq_lens,
        prev_index=prev_index, num_tokens=total, num_reqs_bucket=r_bucket,
    )
