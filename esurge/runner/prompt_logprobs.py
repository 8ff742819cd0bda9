"""Prompt logprobs: the log-probability of each prompt token given its prefix.

Computed from the step's final hidden states for the rows of requests that
asked, in the same step as their prefill chunk. The first prompt token has no
prefix, so its entry is None. Positions already reported (before a
preemption, say) are not reported again.
"""

from __future__ import annotations

import jax
import numpy as np

from esurge.models.forward import ModelState
from esurge.outputs import TokenLogprobs
from esurge.runner.device_step import prompt_logprobs_step
from esurge.runner.host_read import to_host
from esurge.runner.input_batch import InputBatch
from esurge.runner.sampler import MAX_LOGPROBS
from esurge.runner.step_inputs import StepInputs

__all__ = ["PromptLogprobsComputer", "gather_rows"]

# Rows scored per call: the LM head over a step's every row (up to 8,192 with
# whole-context steps, 49,152 logits each for SmolLM2) took seconds, for rows
# that were mostly padding, and so did each token bucket's warm-up run of it.
ROWS_PER_CALL = 256


def gather_rows(num_tokens: int) -> int:
    """Rows one prompt-logprobs call scores in a step of num_tokens rows."""
    return min(num_tokens, ROWS_PER_CALL)


class PromptLogprobsComputer:
    """Tracks, per request, which prompt positions were reported."""

    def __init__(self, model_state: ModelState) -> None:
        self._shell = model_state.shell_state()
        self._next: dict[str, int] = {}  # next prompt position to report

    def release(self, req_ids: set[str]) -> None:
        """Forget requests that finished."""
        for req_id in req_ids:
            self._next.pop(req_id, None)

    def compute(self, ib: InputBatch, inputs: StepInputs,
                hidden: jax.Array) -> dict[str, list[TokenLogprobs | None]]:
        """hidden: [T, H] final hidden states of the step."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[str, int, int, bool]] = []  # req, first entry, count, lead None
        starts = np.asarray(inputs.batch.query_start_loc)
        for i, req_id in enumerate(inputs.req_ids):
            row = int(inputs.rows[i])
            wanted = ib.params[row].prompt_logprobs
            num_prompt = int(ib.num_prompt[row])
            if wanted is None or self._next.get(req_id, 0) >= num_prompt:
                continue
            first = int(inputs.seq_lens[i]) - int(starts[i + 1] - starts[i])
            nxt = self._next.get(req_id, 0)
            lead_none = first == 0 and nxt == 0
            begin = max(first + 1, nxt, 1)  # prompt position whose logprob we report
            end = min(int(inputs.seq_lens[i]), num_prompt - 1) + 1
            count = max(0, end - begin)
            for pos in range(begin, begin + count):
                rows.append(int(starts[i]) + (pos - 1 - first))
                targets.append(int(ib.token_ids[row, pos]))
            spans.append((req_id, len(rows) - count, count, lead_none))
            # Kept once complete: a preempted request recomputes its prompt.
            self._next[req_id] = max(nxt, begin + count)
        if not spans:
            return {}
        return self._gather(ib, inputs, hidden, rows, targets, spans)

    def _gather(self, ib: InputBatch, inputs: StepInputs, hidden: jax.Array, rows: list[int],
                targets: list[int], spans: list[tuple[str, int, int, bool]]
                ) -> dict[str, list[TokenLogprobs | None]]:
        size = gather_rows(int(hidden.shape[0]))
        calls = max(1, -(-len(rows) // size))  # a span may hold only its leading None
        row_arr = np.zeros(calls * size, np.int32)
        tgt_arr = np.zeros(calls * size, np.int32)
        row_arr[:len(rows)] = rows
        tgt_arr[:len(targets)] = targets
        parts = [prompt_logprobs_step(self._shell, hidden, row_arr[at:at + size],
                                      tgt_arr[at:at + size], MAX_LOGPROBS)
                 for at in range(0, calls * size, size)]
        ids, lps, ranks = (np.concatenate([to_host(part[i]) for part in parts])
                           for i in range(3))
        out: dict[str, list[TokenLogprobs | None]] = {}
        for req_id, first, count, lead_none in spans:
            n = ib.params[ib.row_of[req_id]].prompt_logprobs or 0
            entries: list[TokenLogprobs | None] = [None] if lead_none else []
            for k in range(first, first + count):
                entries.append(TokenLogprobs.from_row(ids[k], lps[k], ranks[k], n))
            out[req_id] = entries
        return out
