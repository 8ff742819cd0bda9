"""The runner's persistent batch: per-request host state kept across steps.

Each running request owns one row. Rows are filled from the scheduler's
diffs (new requests in full, cached ones as new pages and counts) and
condensed after removals so rows [0, num_rows) are always live. Token ids,
page tables and sampling options live in preallocated numpy arrays, so a
step's inputs are built with a few vectorised gathers.
"""

from __future__ import annotations

import numpy as np

from esurge.models.kv_cache import NULL_PAGE
from esurge.runner.sampling_batch import SamplingBatch
from esurge.sampling_params import SamplingParams
from esurge.scheduler.output import NewRequestData, SchedulerOutput

__all__ = ["InputBatch"]


class InputBatch:
    """Host-side state of up to max_rows running requests."""

    def __init__(self, max_rows: int, max_model_len: int, num_groups: int,
                 max_pages_per_req: int, vocab_size: int) -> None:
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.req_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        self.params: list[SamplingParams] = []
        self.token_ids = np.zeros((max_rows, max_model_len), np.int32)
        self.num_known = np.zeros(max_rows, np.int32)  # tokens whose ids are on the host
        self.num_prompt = np.zeros(max_rows, np.int32)
        self.num_computed = np.zeros(max_rows, np.int32)
        self.page_tables = np.zeros((num_groups, max_rows, max_pages_per_req), np.int32)
        self.num_pages = np.zeros((num_groups, max_rows), np.int32)
        self.sampling = SamplingBatch(max_rows, vocab_size)

    @property
    def num_rows(self) -> int:
        """Live rows."""
        return len(self.req_ids)

    def add(self, new: NewRequestData) -> int:
        """Install a new (or resumed) request in the next free row."""
        if new.req_id in self.row_of:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        row = len(self.req_ids)
        if row >= self.max_rows:
            raise ValueError(f"the batch is full ({self.max_rows} rows)")
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {len(tokens)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        self.req_ids.append(new.req_id)
        self.params.append(new.sampling_params)
        self.row_of[new.req_id] = row
        self.token_ids[row, :len(tokens)] = tokens
        self.num_known[row] = len(tokens)
        self.num_prompt[row] = len(new.prompt_token_ids)
        self.num_computed[row] = new.num_computed_tokens
        self.num_pages[:, row] = 0
        # A reused row must not show its last request's pages past this one's.
        self.page_tables[:, row] = NULL_PAGE
        self.append_pages(row, new.page_ids)
        self.sampling.set_row(row, new.sampling_params, list(new.prompt_token_ids),
                              list(new.output_token_ids), new.eos_token_id)
        return row

    def apply(self, so: SchedulerOutput) -> set[str]:
        """Apply a step's schedule: drop the requests that left, update the cached
        ones, add the new ones. Returns the ids of the rows dropped (a request
        sent again as new, after preemption, is among them)."""
        gone = so.finished_req_ids | so.preempted_req_ids
        gone.update(new.req_id for new in so.scheduled_new_reqs if new.req_id in self.row_of)
        self.remove(gone)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            row = self.row_of[req_id]
            pages = cached.new_page_ids[i]
            if pages is not None:
                self.append_pages(row, pages)
            self.num_computed[row] = cached.num_computed_tokens[i]
        for new in so.scheduled_new_reqs:
            self.add(new)
        return gone

    def append_pages(self, row: int, page_ids: tuple[tuple[int, ...], ...]) -> None:
        """Extend a row's page table of each group."""
        for group, ids in enumerate(page_ids):
            start = int(self.num_pages[group, row])
            end = start + len(ids)
            if end > self.page_tables.shape[2]:
                raise ValueError(f"request {self.req_ids[row]!r} needs {end} pages, more than "
                                 f"max_pages_per_req={self.page_tables.shape[2]}")
            self.page_tables[group, row, start:end] = ids
            self.num_pages[group, row] = end

    def remove(self, req_ids: set[str]) -> None:
        """Drop requests, then condense the remaining rows into [0, num_rows)."""
        if not req_ids.intersection(self.row_of):
            return
        keep = [r for r, rid in enumerate(self.req_ids) if rid not in req_ids]
        for new_row, old_row in enumerate(keep):
            if new_row != old_row:
                self._move(old_row, new_row)
        for row in range(len(keep), len(self.req_ids)):
            self.sampling.clear_row(row)
        self.req_ids = [self.req_ids[r] for r in keep]
        self.params = [self.params[r] for r in keep]
        self.row_of = {rid: row for row, rid in enumerate(self.req_ids)}

    def _move(self, src: int, dst: int) -> None:
        n = int(self.num_known[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_known, self.num_prompt, self.num_computed):
            arr[dst] = arr[src]
        self.page_tables[:, dst] = self.page_tables[:, src]
        self.num_pages[:, dst] = self.num_pages[:, src]
        self.sampling.move_row(src, dst)

    def record_sampled(self, req_ids: list[str], sampled: np.ndarray,  # [R] bool
                       positions: np.ndarray,  # [R] int32
                       tokens: np.ndarray,  # [K, >= R] int32
                       ) -> None:
        """Write request i's sampled tokens tokens[:, i] at positions[i] onwards
        (K = 1 for a plain step, the burst length for a decode burst) where
        sampled[i], in one scatter; requests no longer in the batch (preempted
        by a step dispatched since) are skipped."""
        n = len(req_ids)
        rows = np.fromiter((self.row_of.get(r, -1) for r in req_ids), np.int64, n)
        keep = sampled & (rows >= 0)
        rows, tokens = rows[keep], tokens[:, :n][:, keep]  # [m], [K, m]
        if not len(rows):
            return
        at = positions[keep][None, :] + np.arange(len(tokens))[:, None]  # [K, m]
        if int(at[-1].max()) >= self.max_model_len:
            bad = self.req_ids[int(rows[int(at[-1].argmax())])]
            raise ValueError(f"request {bad!r} would exceed max_model_len")
        self.token_ids[rows[None, :], at] = tokens
        self.num_known[rows] = np.maximum(self.num_known[rows], at[-1] + 1)
        for step_tokens in tokens:
            self.sampling.observe_rows(rows, step_tokens)

    def record_tokens(self, row: int, start: int, tokens: list[int]) -> None:
        """Write tokens at positions [start, start + len) once their ids are known."""
        end = start + len(tokens)
        if end > self.max_model_len:
            raise ValueError(f"request {self.req_ids[row]!r} would exceed max_model_len")
        self.token_ids[row, start:end] = tokens
        self.num_known[row] = max(int(self.num_known[row]), end)
