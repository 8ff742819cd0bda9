"""Host-side sampling state of the persistent batch, one row per running request.

Scalar options live in preallocated numpy arrays indexed by row, written once
when a request joins, so building a step's `SamplingTensors` is a few slices.
Dense per-vocabulary state (penalty counts, masks) is kept only for the rows
that asked for an option needing it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import numpy as np

from esurge.runner.sampler import SamplerVariant, SamplingTensors
from esurge.sampling_params import SamplingParams

__all__ = ["DenseRowState", "SamplingBatch"]


def _split_seed(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32


@dataclass(slots=True)
class DenseRowState:
    """Per-vocabulary state of one request that uses penalties or masks."""

    params: SamplingParams
    stop_ids: tuple[int, ...]  # masked while fewer than min_tokens were generated
    base: np.ndarray  # [V] float32: logit bias and allowed-token mask
    seen: np.ndarray  # [V] bool: in prompt or output
    counts: np.ndarray  # [V] int32: occurrences in output
    output: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, params: SamplingParams, prompt: list[int], output: list[int],
               eos_token_id: int | None, vocab: int) -> DenseRowState:
        """State for a request joining with `output` already generated (resumed)."""
        base = np.zeros(vocab, np.float32)
        if params.allowed_token_ids is not None:
            base[:] = -np.inf
            base[list(params.allowed_token_ids)] = 0.0
        for token, bias in (params.logit_bias or {}).items():
            base[token] += bias
        stop_ids = tuple(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            stop_ids += (eos_token_id,)
        seen = np.zeros(vocab, bool)
        seen[np.asarray(prompt, np.int64)] = True
        state = cls(params, stop_ids, base, seen, np.zeros(vocab, np.int32))
        state.observe(output)
        return state

    def observe(self, tokens: list[int]) -> None:
        """Account for newly generated tokens."""
        if not tokens:
            return
        arr = np.asarray(tokens, np.int64)
        np.add.at(self.counts, arr, 1)
        self.seen[arr] = True
        self.output.extend(tokens)

    def additive(self) -> np.ndarray:
        """[V] float32 mask/bias for the next token."""
        words = self.params.bad_words_token_ids
        firm = [word[0] for word in words if len(word) == 1]
        if len(self.output) < self.params.min_tokens:
            firm.extend(self.stop_ids)
        completing = [word[-1] for word in words
                      if len(word) > 1 and tuple(self.output[1 - len(word):]) == word[:-1]]
        if not firm and not completing:
            return self.base
        row = self.base.copy()
        # Admission refuses an allow-list that min_tokens and the one-token bad
        # words empty, so these bans always leave a token to sample.
        row[firm] = -np.inf
        if completing:
            kept = row[completing]
            row[completing] = -np.inf
            # A multi-token bad word can still ban the last token left; with
            # nothing left the sampler would pick outside the allow-list, so
            # the list (and min_tokens) win over that word.
            if self.params.allowed_token_ids is not None and not np.isfinite(row).any():
                row[completing] = kept
        return row


class SamplingBatch:
    """Sampling options of up to `max_rows` requests, addressed by row."""

    def __init__(self, max_rows: int, vocab_size: int) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.temperature = np.zeros(max_rows, np.float32)
        self.top_k = np.full(max_rows, vocab_size, np.int32)
        self.top_p = np.ones(max_rows, np.float32)
        self.min_p = np.zeros(max_rows, np.float32)
        self.seeds = np.zeros((max_rows, 2), np.uint32)
        self.presence = np.zeros(max_rows, np.float32)
        self.frequency = np.zeros(max_rows, np.float32)
        self.repetition = np.ones(max_rows, np.float32)
        self.num_logprobs = np.full(max_rows, -1, np.int32)
        self.dense: list[DenseRowState | None] = [None] * max_rows
        self._num_dense = 0  # rows whose dense entry is not None

    def set_row(self, row: int, params: SamplingParams, prompt: list[int], output: list[int],
                eos_token_id: int | None) -> None:
        """Install a request's options in `row`."""
        self.temperature[row] = params.temperature
        self.top_k[row] = min(params.top_k or self.vocab_size, self.vocab_size)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.seeds[row] = _split_seed(seed)
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self._put_dense(row, (
            DenseRowState.create(params, prompt, output, eos_token_id, self.vocab_size)
            if params.uses_token_state else None
        ))

    def _put_dense(self, row: int, state: DenseRowState | None) -> None:
        self._num_dense += (state is not None) - (self.dense[row] is not None)
        self.dense[row] = state

    def move_row(self, src: int, dst: int) -> None:
        """Move a row (condensing the batch after removals)."""
        for arr in (self.temperature, self.top_k, self.top_p, self.min_p, self.seeds,
                    self.presence, self.frequency, self.repetition, self.num_logprobs):
            arr[dst] = arr[src]
        self._put_dense(dst, self.dense[src])
        self.clear_row(src)

    def clear_row(self, row: int) -> None:
        """Reset a row to inert padding (greedy, no options)."""
        self.temperature[row] = 0.0
        self.top_k[row] = self.vocab_size
        self.top_p[row] = 1.0
        self.min_p[row] = 0.0
        self.num_logprobs[row] = -1
        self._put_dense(row, None)

    def observe(self, row: int, tokens: list[int]) -> None:
        """Feed generated tokens to a row's dense state, if it has one."""
        state = self.dense[row]
        if state is not None:
            state.observe(tokens)

    def observe_rows(self, rows: np.ndarray,  # [n] row indices
                     tokens: np.ndarray,  # [n] one generated token per row
                     ) -> None:
        """observe() for one token per row; rows without dense state cost nothing."""
        if not self._num_dense:
            return
        for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
            self.observe(row, [token])

    def variant(self, rows: np.ndarray) -> SamplerVariant:
        """The static features the given rows need.  rows: [n] row indices."""
        return SamplerVariant(
            all_greedy=not bool((self.temperature[rows] > 0).any()),
            dense=self._num_dense > 0 and any(self.dense[r] is not None for r in rows.tolist()),
            logprobs=bool((self.num_logprobs[rows] >= 0).any()),
        )

    def tensors(self, rows: np.ndarray, bucket: int, positions: np.ndarray,
                variant: SamplerVariant) -> SamplingTensors:
        """Host arrays for the given rows, padded to bucket with inert rows.

        rows: [n] row indices in sampling order; positions: [n] output index
        of the token each row samples.
        """
        n = len(rows)
        index = np.zeros(bucket, np.int64)
        index[:n] = rows
        pad = np.arange(bucket) >= n

        def take(arr: np.ndarray, fill: float | int) -> np.ndarray:
            out = arr[index]
            out[pad] = fill
            return out

        pos = np.zeros(bucket, np.int32)
        pos[:n] = positions
        fields: dict[str, np.ndarray | None] = {}
        if variant.dense:
            fields = self._dense_fields(rows, bucket)
            fields.update(presence_penalty=take(self.presence, 0.0),
                          frequency_penalty=take(self.frequency, 0.0),
                          repetition_penalty=take(self.repetition, 1.0))
        return SamplingTensors(
            temperature=take(self.temperature, 0.0), top_k=take(self.top_k, self.vocab_size),
            top_p=take(self.top_p, 1.0), min_p=take(self.min_p, 0.0),
            seeds=self.seeds[index], positions=pos, **fields,
        )

    def _dense_fields(self, rows: np.ndarray, bucket: int) -> dict[str, np.ndarray | None]:
        additive = np.zeros((bucket, self.vocab_size), np.float32)
        counts = np.zeros((bucket, self.vocab_size), np.int32)
        seen = np.zeros((bucket, self.vocab_size), bool)
        for i, row in enumerate(rows.tolist()):
            state = self.dense[row]
            if state is not None:
                additive[i] = state.additive()
                counts[i] = state.counts
                seen[i] = state.seen
        return {"additive": additive, "output_counts": counts, "seen_mask": seen}
