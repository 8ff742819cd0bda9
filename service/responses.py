"""Engine deltas (`RequestDelta`, one per engine step) as the service's response messages.

The engine hands each stream what a step added, so a `RequestCursor` only
remembers per sample whether it started, ended, and its running totals for
the usage of its last message; nothing is recomputed from cumulative output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from esurge.engine.request_output import CompletionDelta, RequestDelta
from generated.esurge.v1 import engine_pb2, service_pb2
from service.convert import (
    event_to_proto,
    finish_reason_to_proto,
    prompt_logprobs_to_proto,
    set_stop_reason,
    token_logprobs_to_proto,
)

__all__ = ["RequestCursor", "SampleDelta", "coalesce", "sample_request_id"]


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample `index` of a request with n samples."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass(slots=True)
class _SampleState:
    tokens: int = 0
    drafts: int = 0
    accepted: int = 0
    started: bool = False
    finished: bool = False


@dataclass(slots=True)
class SampleDelta:
    """One sample's part of one message."""

    index: int
    first: bool
    token_ids: tuple[int, ...] | list[int]
    text: str
    logprobs: list[engine_pb2.TokenLogprobs]
    num_draft_tokens: int
    num_accepted_tokens: int
    finish_reason: engine_pb2.FinishReason
    stop_reason: int | str | None
    completion_tokens: int
    events: list[engine_pb2.EngineCoreEvent] = field(default_factory=list)


def coalesce(parts: list[SampleDelta]) -> list[SampleDelta]:
    """One part per sample: the parts of steps a reader fell behind on, joined.

    Nothing waits for this: it only joins what is already queued, so a stream
    that keeps up still sends a message per step, and one that fell behind
    sends one message instead of one per missed step.
    """
    joined: dict[int, SampleDelta] = {}
    for part in parts:
        head = joined.get(part.index)
        if head is None:
            joined[part.index] = part
            continue
        joined[part.index] = SampleDelta(
            index=head.index, first=head.first,
            token_ids=(*head.token_ids, *part.token_ids), text=head.text + part.text,
            logprobs=[*head.logprobs, *part.logprobs],
            num_draft_tokens=head.num_draft_tokens + part.num_draft_tokens,
            num_accepted_tokens=head.num_accepted_tokens + part.num_accepted_tokens,
            finish_reason=part.finish_reason, stop_reason=part.stop_reason,
            completion_tokens=part.completion_tokens, events=[*head.events, *part.events])
    return list(joined.values())


@dataclass(slots=True)
class RequestCursor:
    """What a stream has sent of one request: per sample, started / ended and totals."""

    request_id: str
    n: int
    return_text: bool = True
    return_events: bool = False
    prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    _samples: list[_SampleState] = field(default_factory=list)
    _prompt_logprobs: list[engine_pb2.PositionLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        self._samples = [_SampleState() for _ in range(self.n)]

    @property
    def finished(self) -> bool:
        """True once every sample has sent its last delta."""
        return all(s.finished for s in self._samples)

    def take_prompt_logprobs(self) -> list[engine_pb2.PositionLogprobs]:
        """The prompt logprobs delivered since the last call, to send now.

        Chunked prefill delivers them in parts, and a chunk's step may give no
        message to carry its part: the part waits here for the next message.
        """
        out, self._prompt_logprobs = self._prompt_logprobs, []
        return out

    def advance(self, delta: RequestDelta) -> list[SampleDelta]:
        """The message parts of every sample `delta` touched (its prompt
        logprobs wait for `take_prompt_logprobs`)."""
        if delta.first:
            self.prompt_tokens = len(delta.prompt_token_ids)
            self.num_cached_tokens = delta.num_cached_tokens
            self.prompt_token_ids = list(delta.prompt_token_ids)
        if delta.prompt_logprobs:
            self._prompt_logprobs.extend(prompt_logprobs_to_proto(list(delta.prompt_logprobs)))
        out = []
        for completion in delta.outputs:
            part = self._advance_sample(completion)
            if part is not None:
                out.append(part)
        return out

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

    def _advance_sample(self, comp: CompletionDelta) -> SampleDelta | None:
        state = self._samples[comp.index]
        if state.finished:
            return None
        text = comp.text if self.return_text else ""
        events = [event_to_proto(e) for e in comp.events] if self.return_events else []
        if state.started and not comp.token_ids and not text and not events and (
                not comp.finished):
            return None
        part = SampleDelta(
            index=comp.index, first=not state.started, token_ids=comp.token_ids, text=text,
            logprobs=[token_logprobs_to_proto(lp) for lp in comp.logprobs],
            num_draft_tokens=comp.num_draft_tokens,
            num_accepted_tokens=comp.num_accepted_tokens,
            finish_reason=finish_reason_to_proto(comp.finish),
            stop_reason=comp.stop_reason, completion_tokens=comp.num_tokens, events=events)
        state.tokens = comp.num_tokens
        state.drafts += comp.num_draft_tokens
        state.accepted += comp.num_accepted_tokens
        state.started, state.finished = True, comp.finished
        return part

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
