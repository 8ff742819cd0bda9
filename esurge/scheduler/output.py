"""What one `Scheduler.schedule()` call hands to the model runner.

New requests (and requests resumed after preemption) come in full as
`NewRequestData`; requests the runner already holds come as one columnar
`CachedRequestData` diff. Page ids are given per cache group, in group order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from esurge.request import EngineRequest
from esurge.sampling_params import SamplingParams

if TYPE_CHECKING:
    from esurge.structured_output.compiler import CompiledGrammar

__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]

PageIds = tuple[tuple[int, ...], ...]  # one tuple of page ids per cache group


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Everything the runner needs to start (or restart) a request.

    num_computed_tokens is the number of leading tokens whose KV is already in
    the cache (prefix-cache hits); this step's tokens start there. A request
    resumed after preemption is sent again as NewRequestData (its old state on
    the runner was dropped with the preemption), so output_token_ids holds the
    tokens generated before it was preempted; it is empty for a fresh request.
    grammar is the compiled output constraint, None for an unconstrained request.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    page_ids: PageIds
    num_computed_tokens: int
    eos_token_id: int | None
    output_token_ids: tuple[int, ...]
    grammar: CompiledGrammar | None = None

    @classmethod
    def from_request(cls, request: EngineRequest, page_ids: PageIds) -> NewRequestData:
        """Snapshot a request as scheduled now (before this step's tokens count)."""
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            page_ids=page_ids,
            num_computed_tokens=request.num_computed_tokens,
            eos_token_id=request.eos_token_id,
            output_token_ids=tuple(request.output_token_ids),
            grammar=request.grammar,
        )


@dataclass(frozen=True, slots=True)
class CachedRequestData:
    """Diffs for requests the runner already holds, one column entry per request.

    A request resumed after preemption is sent as NewRequestData, and the
    runner keeps the tokens it sampled, so no resumed flag or token column is
    needed. new_page_ids[i] is None when the request got no new page this step.
    num_computed_tokens[i] is where this step's tokens start.
    """

    req_ids: list[str] = field(default_factory=list)
    new_page_ids: list[PageIds | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        """Number of requests described."""
        return len(self.req_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step's schedule.

    num_scheduled_tokens maps every scheduled request to its token count this
    step (prompt chunk, decode token, plus speculative tokens to verify).
    scheduled_spec_decode_tokens maps a request to the draft tokens the runner
    must verify in this step. finished_req_ids are requests that ended since
    the previous step (the runner drops their state); preempted_req_ids are
    requests evicted in this step (likewise dropped; they come back later as
    NewRequestData). num_seq_bucket is the request count the runner pads to:
    the smallest max_num_seq_buckets entry >= the number of scheduled requests,
    or without buckets the smallest power of two >= it, capped at max_num_seqs
    (the smallest bucket for an empty step).

    num_decode_steps > 1 marks a decode burst: every scheduled request is in
    plain decode with stateless sampling (SamplingParams.stateless_sampling)
    and is scheduled num_decode_steps tokens, its last known (or in-flight)
    token and the ones the step itself generates; the runner runs that many
    decode iterations and returns one token per iteration and request.

    num_waiting_reqs is how many requests still wait after this step: the
    batch a step admitting prompts fills toward.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, Sequence[int]]
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    num_seq_bucket: int
    num_decode_steps: int = 1
    num_waiting_reqs: int = 0

    @property
    def num_scheduled_reqs(self) -> int:
        """Requests that run in this step."""
        return len(self.num_scheduled_tokens)

    def is_empty(self) -> bool:
        """True when the step runs no token."""
        return self.total_num_scheduled_tokens == 0
