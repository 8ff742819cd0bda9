"""Engine results (`RequestOutput` snapshots) as the service's response messages.

A `RequestCursor` remembers, per sample, how much of a request's cumulative
output a stream has already sent; each new snapshot yields only the rest.
Because deltas come from cumulative fields, a stream may skip snapshots
(a slow client gets the latest one, carrying everything since its last
message) and nothing is lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from esurge.engine.request_output import CompletionOutput, RequestOutput
from esurge.engine_types import EngineCoreEvent, EngineCoreEventType
from generated.esurge.v1 import engine_pb2, service_pb2
from service.convert import (
    event_to_proto,
    finish_reason_to_proto,
    prompt_logprobs_to_proto,
    set_stop_reason,
    token_logprobs_to_proto,
)

__all__ = ["RequestCursor", "SampleDelta", "sample_request_id"]

def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample `index` of a request with n samples."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass(slots=True)
class _SampleState:
    tokens: int = 0
    text: int = 0
    logprobs: int = 0
    drafts: int = 0
    accepted: int = 0
    started: bool = False
    finished: bool = False


@dataclass(slots=True)
class SampleDelta:
    """What is new for one sample since the stream's previous message."""

    index: int
    first: bool
    token_ids: list[int]
    text: str
    logprobs: list[engine_pb2.TokenLogprobs]
    num_draft_tokens: int
    num_accepted_tokens: int
    finish_reason: engine_pb2.FinishReason
    stop_reason: int | str | None
    completion_tokens: int
    events: list[engine_pb2.EngineCoreEvent] = field(default_factory=list)


@dataclass(slots=True)
class RequestCursor:
    """How far a stream got in one request's output."""

    request_id: str
    n: int
    return_text: bool = True
    return_events: bool = False
    prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    _samples: list[_SampleState] = field(default_factory=list)
    _prompt_logprobs_sent: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        self._samples = [_SampleState() for _ in range(self.n)]

    @property
    def finished(self) -> bool:
        """True once every sample has sent its last delta."""
        return all(s.finished for s in self._samples)

    def new_prompt_logprobs(self, output: RequestOutput) -> list[engine_pb2.PositionLogprobs]:
        """Prompt logprobs not sent yet (chunked prefill delivers them in parts)."""
        entries = output.prompt_logprobs or []
        fresh = entries[self._prompt_logprobs_sent:]
        self._prompt_logprobs_sent = len(entries)
        return prompt_logprobs_to_proto(fresh)

    def advance(self, output: RequestOutput) -> list[SampleDelta]:
        """Deltas of every sample that has something new in `output`."""
        self.prompt_tokens = len(output.prompt_token_ids)
        self.num_cached_tokens = output.num_cached_tokens
        self.prompt_token_ids = output.prompt_token_ids
        deltas = []
        for completion in output.outputs:
            delta = self._advance_sample(completion, output)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def abort_remaining(self) -> list[SampleDelta]:
        """Final ABORT deltas for the samples that have not finished."""
        deltas = []
        for index, state in enumerate(self._samples):
            if state.finished:
                continue
            deltas.append(SampleDelta(
                index=index, first=not state.started, token_ids=[], text="", logprobs=[],
                num_draft_tokens=0, num_accepted_tokens=0,
                finish_reason=engine_pb2.FINISH_REASON_ABORT, stop_reason=None,
                completion_tokens=state.tokens))
            state.started = state.finished = True
        return deltas

    def _advance_sample(self, comp: CompletionOutput, output: RequestOutput) -> SampleDelta | None:
        state = self._samples[comp.index]
        if state.finished:
            return None
        new_tokens = comp.token_ids[state.tokens:]
        new_text = comp.text[state.text:] if self.return_text else ""
        if state.started and not new_tokens and not new_text and not comp.finished:
            return None
        logprobs = comp.logprobs or []
        delta = SampleDelta(
            index=comp.index, first=not state.started, token_ids=list(new_tokens),
            text=new_text,
            logprobs=[token_logprobs_to_proto(lp) for lp in logprobs[state.logprobs:]],
            num_draft_tokens=comp.num_draft_tokens - state.drafts,
            num_accepted_tokens=comp.num_accepted_tokens - state.accepted,
            finish_reason=finish_reason_to_proto(comp.finish),
            stop_reason=comp.stop_reason, completion_tokens=len(comp.token_ids),
            events=self._first_events(output) if self.return_events and not state.started
            else [],
        )
        state.tokens, state.text = len(comp.token_ids), len(comp.text)
        state.logprobs, state.drafts = len(logprobs), comp.num_draft_tokens
        state.accepted, state.started = comp.num_accepted_tokens, True
        state.finished = comp.finished
        return delta

    @staticmethod
    def _first_events(output: RequestOutput) -> list[engine_pb2.EngineCoreEvent]:
        # The engine's per-request metrics keep when the request was queued
        # and first scheduled (monotonic clock); later events are not kept.
        metrics = output.metrics
        if metrics is None:
            return []
        events = [EngineCoreEvent(EngineCoreEventType.QUEUED, metrics.arrival_time)]
        if metrics.first_scheduled_time is not None:
            events.append(EngineCoreEvent(EngineCoreEventType.SCHEDULED,
                                          metrics.first_scheduled_time))
        return [event_to_proto(e) for e in events]

    # ---- message builders ----------------------------------------------------

    def prompt_info(self, with_token_ids: bool) -> service_pb2.PromptInfo:
        """The prompt's size and cache hits (and ids when asked)."""
        return service_pb2.PromptInfo(
            num_prompt_tokens=self.prompt_tokens, num_cached_tokens=self.num_cached_tokens,
            prompt_token_ids=self.prompt_token_ids if with_token_ids else ())

    def usage(self, completion_tokens: int, drafts: int = 0,
              accepted: int = 0) -> service_pb2.Usage:
        """Token counts of one sample (or a sum over samples)."""
        return service_pb2.Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
            cached_prompt_tokens=self.num_cached_tokens, num_draft_tokens=drafts,
            num_accepted_tokens=accepted)

    def generate_response(self, delta: SampleDelta, *, with_prompt_ids: bool,
                          total_drafts: tuple[int, int]) -> service_pb2.GenerateResponse:
        """One Generate stream message for a sample delta.

        `total_drafts` is the sample's (drafted, accepted) totals so far, for
        the usage of its last message.
        """
        msg = service_pb2.GenerateResponse(
            request_id=self.request_id, index=delta.index, token_ids=delta.token_ids,
            text=delta.text, logprobs=delta.logprobs, events=delta.events,
            finish_reason=delta.finish_reason)
        if delta.first:
            msg.prompt_info.CopyFrom(self.prompt_info(with_prompt_ids))
        if delta.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            set_stop_reason(msg, delta.stop_reason)
            msg.usage.CopyFrom(self.usage(delta.completion_tokens, *total_drafts))
        return msg

    def engine_core_output(self, delta: SampleDelta) -> engine_pb2.EngineCoreOutput:
        """The EngineStream form of a sample delta, under the sample's engine id."""
        msg = engine_pb2.EngineCoreOutput(
            request_id=sample_request_id(self.request_id, delta.index, self.n),
            new_token_ids=delta.token_ids, new_logprobs=delta.logprobs,
            finish_reason=delta.finish_reason,
            num_cached_tokens=self.num_cached_tokens if delta.first else 0,
            events=delta.events, num_draft_tokens=delta.num_draft_tokens,
            num_accepted_tokens=delta.num_accepted_tokens)
        set_stop_reason(msg, delta.stop_reason if delta.finish_reason else None)
        return msg

    def sample_totals(self, index: int) -> tuple[int, int]:
        """(drafted, accepted) tokens of a sample so far."""
        state = self._samples[index]
        return state.drafts, state.accepted
