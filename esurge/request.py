"""A request as the engine core tracks it, and its lifecycle status."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from esurge.engine_types import EngineCoreEvent, EngineCoreEventType, FinishReason
from esurge.sampling_params import SamplingParams

if TYPE_CHECKING:
    from esurge.structured_output.compiler import CompiledGrammar

__all__ = ["EngineRequest", "EngineRequestStatus"]


class EngineRequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: EngineRequestStatus) -> bool:
        """True for every terminal status."""
        return status > EngineRequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: EngineRequestStatus) -> FinishReason | None:
        """The client-facing reason for a terminal status, None otherwise."""
        return _FINISH_REASONS.get(status)


# IGNORED requests (too long to ever run) end like a length cap, as in vLLM.
_FINISH_REASONS: dict[EngineRequestStatus, FinishReason] = {
    EngineRequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    EngineRequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    EngineRequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    EngineRequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One generation request and its progress.

    num_computed_tokens counts tokens whose KV is in the cache;
    num_cached_tokens is the prefix-cache hit length found when the request was
    first scheduled (None before that). spec_token_ids are draft tokens waiting
    to be verified; num_output_placeholders counts tokens scheduled with async
    scheduling whose values are not known yet. grammar is the compiled
    constraint of a request with structured_outputs (the runner follows it).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    client_index: int = 0
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    cache_salt: str | None = None
    status: EngineRequestStatus = EngineRequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    spec_token_ids: Sequence[int] = field(default_factory=list)
    events: list[EngineCoreEvent] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_output_placeholders: int = 0
    grammar: CompiledGrammar | None = None
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids of request {self.request_id!r} must not be empty")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_token_ids):
            raise ValueError(
                f"prompt_token_ids of request {self.request_id!r} must be non-negative ints"
            )
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus drafts to verify: the target of the next step."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def max_tokens(self) -> int | None:
        """The request's output cap (None: bounded by max_model_len only)."""
        return self.sampling_params.max_tokens

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        """Record newly generated tokens."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        """True once the request has reached a terminal status."""
        return EngineRequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        """The client-facing finish reason, None while running."""
        return EngineRequestStatus.get_finished_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Stamp a lifecycle event, drained into the next output."""
        self.events.append(EngineCoreEvent.new(event_type, timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """Events since the last output, clearing them."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events
