"""Builds one step's padded inputs from the persistent batch, with numpy only."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from esurge.models.batch import ForwardBatch, tile_layout
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

    With speculative decoding (num_spec > 0), num_drafts[i] draft tokens of
    request i are verified: its last 1 + num_drafts[i] token rows get logits,
    laid out at logits rows [i * (1 + num_spec), ...); sample_positions[i] is
    then the output index of the first token the step emits. Drafts the
    device still holds (the previous step proposed them) are not copied to
    the host: draft_slots[i] >= 0 is their slot in the head's draft buffer
    ([slots, num_spec]), and draft_feed[t] >= 0 the flat buffer index of
    token row t's id (input_ids holds a stale value there).

    A request of a speculative step still in flight (follow_src[i] >= 0) is
    laid out as if that step accepted every draft; the device moves it back
    over the drafts it rejected (device_step.follow_in_flight), and its first
    token row takes that step's last token (follow_index).

    A decode burst (num_steps > 1) runs num_steps iterations: `batch` is the
    first (one token per request), iteration j moves every request one
    position on and writes its keys and values to burst_slots[j - 1].

    num_reqs_bucket is the sampler's row count; a plain step's batch may pad
    its requests further, to StepBuckets.model_requests.
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
    num_drafts: np.ndarray  # [R] int32
    num_spec: int = 0
    num_steps: int = 1
    burst_slots: np.ndarray | None = None  # [num_steps - 1, G, T_bucket] int32
    draft_slots: np.ndarray | None = None  # [R] int32
    draft_feed: np.ndarray | None = None  # [T_bucket] int32
    # Requests of a speculative step still in flight (build_step_inputs' follows):
    # follow_src[i] is request i's row there (-1: none), follow_index[t] that
    # row for the token row fed its last token.
    follow_src: np.ndarray | None = None  # [R_model] int32
    follow_index: np.ndarray | None = None  # [T_bucket] int32
    # Token rows a request computes again (it was moved back for its draft head,
    # esurge/runner/steps/speculative/head_sync.py) write their keys and values
    # to the null page (the cache holds them: the pages may be shared through
    # the prefix cache); kept_slots[g, t] is where they are, for the head.
    kept_slots: np.ndarray | None = None  # [G, T_bucket] int32, -1 where not recomputed


# The slot of a request's drafts in the draft buffer of the runner's head,
# for drafts still on the device there (None: their values are on the host).
DraftSlot = Callable[[Sequence[int]], int | None]


def _write_drafts(ib: InputBatch, sched: list[str], rows: np.ndarray,
                  spec: dict[str, Sequence[int]], slot_of: DraftSlot | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Put each request's drafts after its known tokens (scratch, num_known
    unchanged), or note the buffer slot of drafts the device holds:
    (num_drafts [R], slots [R], -1 where written here)."""
    num_drafts = np.zeros(len(sched), np.int32)
    slots = np.full(len(sched), -1, np.int32)
    for i, req_id in enumerate(sched):
        drafts = spec.get(req_id)
        if not drafts:
            continue
        num_drafts[i] = len(drafts)
        slot = None if slot_of is None else slot_of(drafts)
        if slot is not None:
            slots[i] = slot
            continue
        row, start = int(rows[i]), int(ib.num_known[rows[i]])
        ib.token_ids[row, start:start + len(drafts)] = list(drafts)
    return num_drafts, slots


def _draft_feed(slots: np.ndarray, num_drafts: np.ndarray, ends: np.ndarray, width: int,
                t_bucket: int) -> np.ndarray:
    """[t_bucket] int32: for each draft token row fed from the draft buffer, its
    index in the flattened [slots, width] buffer; -1 elsewhere."""
    feed = np.full(t_bucket, -1, np.int32)
    for i in np.flatnonzero(slots >= 0).tolist():
        nd, end = int(num_drafts[i]), int(ends[i])
        feed[end - nd:end] = int(slots[i]) * width + np.arange(nd)
    return feed


def _logits_rows(ends: np.ndarray, num_drafts: np.ndarray, r_bucket: int,
                 num_spec: int) -> np.ndarray:
    """Token rows whose logits are wanted: the last one per request, or its last
    1 + num_drafts[i] at [i * (1 + num_spec), ...) when verifying drafts."""
    if not num_spec:
        out = np.zeros(r_bucket, np.int32)
        out[:len(ends)] = ends - 1
        return out
    width = 1 + num_spec
    out = np.zeros(r_bucket * width, np.int32)
    for i, (end, nd) in enumerate(zip(ends.tolist(), num_drafts.tolist(), strict=True)):
        out[i * width:i * width + nd + 1] = np.arange(end - 1 - nd, end)
    return out


QUERY_TILE = 16


def query_tile_for(num_scheduled: np.ndarray, tiled: bool = True) -> int:
    """Tile attention queries when some request brings a prefill-sized chunk:
    its rows then share one key gather per tile. Decode-only steps keep one
    row per request. tiled=False (the CPU kernel runs attention and groups
    rows itself) never tiles."""
    big = len(num_scheduled) and int(num_scheduled.max()) >= QUERY_TILE
    return QUERY_TILE if tiled and big else 1


def query_tiles_for_bucket(num_tokens_bucket: int, tiled: bool = True) -> tuple[int, ...]:
    """The query tiles a step in this token bucket may use (each compiles once)."""
    return (1, QUERY_TILE) if tiled and num_tokens_bucket >= QUERY_TILE else (1,)


def build_step_inputs(ib: InputBatch, so: SchedulerOutput, buckets: StepBuckets, page_size: int,
                      prev_sample_index: dict[str, int], num_spec: int = 0,
                      tiled: bool = True, draft_slot: DraftSlot | None = None,
                      follows: dict[str, int] | None = None,
                      recompute: Mapping[str, int] | None = None) -> StepInputs:
    """Flatten the scheduled requests into bucket-padded ForwardBatch arrays.

    prev_sample_index maps a request to its sampler row in the step still in
    flight, for tokens whose ids are not on the host yet. num_spec is the
    number of speculative tokens per step (0: speculation off). tiled: see
    query_tile_for. draft_slot finds drafts the head's buffer still holds
    (StepInputs.draft_feed). follows maps the requests of a speculative step
    still in flight to their rows there (StepInputs.follow_src). recompute maps
    requests computing tokens again to the position up to which the cache
    holds them (StepInputs.kept_slots).
    """
    sched = sorted(so.num_scheduled_tokens, key=ib.row_of.__getitem__)
    rows = np.array([ib.row_of[r] for r in sched], np.int64)
    steps = so.num_decode_steps
    # A burst's first iteration feeds one token per request (see StepInputs).
    n_sched = (np.ones(len(sched), np.int64) if steps > 1 else
               np.array([so.num_scheduled_tokens[r] for r in sched], np.int64))
    num_reqs, total = len(sched), int(n_sched.sum())
    t_bucket, r_bucket = buckets.tokens_for(total), buckets.requests_for(num_reqs)
    # The sampler keeps r_bucket; a plain step's model pads to the floor.
    r_model = buckets.model_requests(r_bucket) if steps == 1 and not num_spec else r_bucket
    ends = np.cumsum(n_sched)
    starts = ends - n_sched
    num_drafts, draft_slots = (
        _write_drafts(ib, sched, rows, so.scheduled_spec_decode_tokens, draft_slot) if num_spec
        else (np.zeros(num_reqs, np.int32), None))
    req_of_token = np.repeat(np.arange(num_reqs), n_sched)
    positions = ib.num_computed[rows][req_of_token] + (np.arange(total) - starts[req_of_token])
    token_rows = rows[req_of_token]
    ids = ib.token_ids[token_rows, positions]
    unknown = positions >= ib.num_known[token_rows] + num_drafts[req_of_token]
    follow_src = None if follows is None else _follow_src(sched, follows, r_model)
    if follow_src is not None:
        unknown &= follow_src[req_of_token] < 0  # fed from the step in flight instead
        on_host = (follow_src[:num_reqs] >= 0) & (num_drafts > 0)
        if draft_slots is not None:
            on_host &= draft_slots < 0
        if on_host.any():  # their positions are not known on the host to write them at
            raise ValueError(f"request {sched[int(on_host.argmax())]!r} follows a step in "
                             "flight with drafts that are not on the device")
    prev_index = np.full(t_bucket, -1, np.int32)
    if unknown.any():
        prev_index[:total][unknown] = [prev_sample_index[sched[i]]
                                       for i in req_of_token[unknown].tolist()]
    seq_lens = (ib.num_computed[rows] + n_sched).astype(np.int32)
    samples = seq_lens >= ib.num_known[rows]
    page_tables = ib.page_tables[:, rows, :]  # [G, R, P]
    logical = positions // page_size
    slot = page_tables[:, req_of_token, logical] * page_size + positions % page_size
    kept_slots = _recomputed(slot, sched, req_of_token, positions, recompute, t_bucket)

    def pad(arr: np.ndarray, size: int, fill: int = 0) -> np.ndarray:
        out = np.full((*arr.shape[:-1], size), fill, np.int32)
        out[..., :arr.shape[-1]] = arr
        return out

    tables = np.full((page_tables.shape[0], r_model, page_tables.shape[2]), NULL_PAGE, np.int32)
    tables[:, :num_reqs] = page_tables
    qsl = np.full(r_model + 1, total, np.int32)
    qsl[:num_reqs] = starts
    tile = query_tile_for(n_sched, tiled)
    tile_rows, row_in_tiles = (tile_layout(n_sched, t_bucket, r_model, tile) if tile > 1
                               else (None, None))
    batch = ForwardBatch(
        input_ids=pad(ids, t_bucket), positions=pad(positions, t_bucket),
        token_req=pad(req_of_token, t_bucket), slot_mapping=pad(slot, t_bucket, NULL_PAGE),
        page_tables=tables, query_start_loc=qsl, seq_lens=pad(seq_lens, r_model),
        logits_indices=_logits_rows(ends, num_drafts, r_model, num_spec),
        query_tile=tile, tile_rows=tile_rows, row_in_tiles=row_in_tiles,
    )
    return StepInputs(
        batch=batch, req_ids=sched, rows=rows, samples=samples,
        sample_positions=(seq_lens - num_drafts - ib.num_prompt[rows]).astype(np.int32),
        seq_lens=seq_lens, prev_index=prev_index, num_tokens=total, num_reqs_bucket=r_bucket,
        num_drafts=num_drafts, num_spec=num_spec, num_steps=steps, draft_slots=draft_slots,
        draft_feed=(None if draft_slots is None
                    else _draft_feed(draft_slots, num_drafts, ends, num_spec, t_bucket)),
        burst_slots=(_burst_slots(page_tables, positions, steps, page_size, t_bucket)
                     if steps > 1 else None),
        follow_src=follow_src,
        follow_index=(None if follow_src is None
                      else _follow_index(follow_src[:num_reqs], starts, t_bucket)),
        kept_slots=kept_slots,
    )


def _recomputed(slot: np.ndarray,  # [G, T] the rows' cache slots (nulled in place)
                sched: list[str], req_of_token: np.ndarray,  # [T]
                positions: np.ndarray,  # [T]
                recompute: Mapping[str, int] | None, t_bucket: int) -> np.ndarray | None:
    """[G, t_bucket] the slots of the rows computed again (-1 elsewhere), which
    then write to the null page; None where no row is."""
    if not recompute:
        return None
    until = np.array([recompute.get(req_id, 0) for req_id in sched], np.int64)
    again = positions < until[req_of_token]
    if not again.any():
        return None
    kept = np.full((slot.shape[0], t_bucket), -1, np.int32)
    kept[:, :len(positions)][:, again] = slot[:, again]
    slot[:, again] = NULL_PAGE
    return kept


def _follow_src(sched: list[str], follows: dict[str, int], r_model: int) -> np.ndarray:
    """[r_model] int32: each scheduled request's row in the step in flight, -1: none."""
    src = np.full(r_model, -1, np.int32)
    src[:len(sched)] = [follows.get(req_id, -1) for req_id in sched]
    return src


def _follow_index(src: np.ndarray,  # [R] int32
                  starts: np.ndarray,  # [R] each request's first token row
                  t_bucket: int) -> np.ndarray:
    """[t_bucket] int32: a following request's first row takes its in-flight row's
    last token; -1 elsewhere."""
    index = np.full(t_bucket, -1, np.int32)
    following = src >= 0
    index[starts[following]] = src[following]
    return index


def _burst_slots(page_tables: np.ndarray,  # [G, R, P] the scheduled requests' pages
                 positions: np.ndarray,  # [R] each request's first burst position
                 steps: int, page_size: int, t_bucket: int) -> np.ndarray:
    """[steps - 1, G, t_bucket] cache slots of positions + 1 .. + steps - 1
    (padding rows write to the null page)."""
    later = positions[None, :] + np.arange(1, steps)[:, None]  # [steps - 1, R]
    reqs = np.arange(len(positions))[None, :]
    slots = page_tables[:, reqs, later // page_size] * page_size + later % page_size  # [G, K-1, R]
    out = np.full((steps - 1, page_tables.shape[0], t_bucket), NULL_PAGE, np.int32)
    out[:, :, :len(positions)] = slots.transpose(1, 0, 2)
    return out
