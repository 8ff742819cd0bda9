"""What the engine core emits: per-request output deltas and their batches."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from esurge.outputs import TokenLogprobs

__all__ = [
    "EngineCoreEvent",
    "EngineCoreEventType",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "FinishReason",
]


class FinishReason(enum.IntEnum):
    """Why a request ended: a stop condition, a length cap, or an abort."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """Lifecycle events reported with timestamps."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(frozen=True, slots=True)
class EngineCoreEvent:
    """One lifecycle event and the monotonic time it happened."""

    type: EngineCoreEventType
    timestamp: float

    @classmethod
    def new(
        cls, event_type: EngineCoreEventType, timestamp: float | None = None
    ) -> EngineCoreEvent:
        """An event stamped now (monotonic clock) unless a time is given."""
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


@dataclass(slots=True)
class EngineCoreOutput:
    """The new part of one request's output after one engine step.

    stop_reason is the stop token id or stop string that ended the request,
    None when it ended otherwise. num_cached_tokens is the prefix-cache hit
    length, reported on the request's first output.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True on the request's last output."""
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    """All outputs of one step for one client."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0
    finished_requests: set[str] | None = None
