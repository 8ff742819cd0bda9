"""Turns engine-core output deltas into caller-facing deltas and results.

Each step gives every touched request an immutable `RequestDelta` (what is
new: tokens, text, logprobs, events) for streaming subscribers; the
cumulative `RequestOutput` is kept alongside for callers that want the
whole result once it is finished (`eSurge.generate`).

Owns detokenization and stop strings: when a sample's text reaches a stop
string, the sample ends here and the caller is told which engine requests to
finish in the scheduler. Parallel samples (n > 1) run as separate engine
requests ("{i}_{request_id}") gathered back under their parent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from esurge.engine.detokenizer import IncrementalDetokenizer
from esurge.engine.request_output import (
    CompletionDelta,
    CompletionOutput,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
)
from esurge.engine_types import EngineCoreEventType, EngineCoreOutput, FinishReason
from esurge.errors import InvalidRequestError, RequestField
from esurge.outputs import TokenLogprobs
from esurge.sampling_params import SamplingParams

__all__ = ["OutputProcessor", "ProcessedOutputs", "child_request_ids"]


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of a request's samples."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


@dataclass(slots=True)
class _Sample:
    parent: _Parent
    completion: CompletionOutput
    detok: IncrementalDetokenizer | None
    metrics: RequestMetrics
    # The text so far, in pieces: joined once, when the sample ends, so a
    # long stream never copies its whole text per step.
    text_parts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Parent:
    output: RequestOutput
    samples: list[_Sample] = field(default_factory=list)
    seen_first: bool = False
    delivered: bool = False  # a delta of it went out


@dataclass(slots=True)
class ProcessedOutputs:
    """One step's results and the stop-string endings to apply.

    deltas[i] is what the step added to the request of request_outputs[i],
    its cumulative result (complete once finished; until then its text is
    not filled in).
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    deltas: list[RequestDelta] = field(default_factory=list)
    stopped_by_string: list[str] = field(default_factory=list)


class OutputProcessor:
    """Per-request output state between the engine core and the caller."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._samples: dict[str, _Sample] = {}
        self._parents: dict[str, _Parent] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> list[str]:
        """Track a request; returns the engine request ids of its samples."""
        if request_id in self._parents:
            raise InvalidRequestError(RequestField.REQUEST_ID,
                                      f"request_id {request_id!r} is already in flight")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        parent = _Parent(RequestOutput(request_id, prompt, list(prompt_token_ids), outputs=[]))
        self._parents[request_id] = parent
        child_ids = child_request_ids(request_id, params.n)
        for index, child_id in enumerate(child_ids):
            detok = None
            if self._tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self._tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output)
            completion = CompletionOutput(index=index,
                                          logprobs=[] if params.logprobs is not None else None)
            parent.output.outputs.append(completion)
            sample = _Sample(parent, completion, detok, RequestMetrics(arrival))
            parent.samples.append(sample)
            self._samples[child_id] = sample
        parent.output.metrics = parent.samples[0].metrics
        return child_ids

    def has_request(self, request_id: str) -> bool:
        """True while the request is in flight."""
        return request_id in self._parents

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's outputs; each touched parent appears once in the result."""
        result = ProcessedOutputs()
        touched: dict[int, tuple[_Parent, list[CompletionDelta], list[TokenLogprobs | None]]] = {}
        now = time.monotonic()
        for out in outputs:
            sample = self._samples.get(out.request_id)
            if sample is None or sample.completion.finished:
                continue
            entry = touched.setdefault(id(sample.parent), (sample.parent, [], []))
            delta, stopped = self._apply(sample, out, now)
            if stopped:
                result.stopped_by_string.append(out.request_id)
            entry[1].append(delta)
            if sample.completion.index == 0:  # every sample scores the same prompt
                entry[2].extend(out.new_prompt_logprobs or ())
            if sample.completion.finished:
                sample.completion.text = "".join(sample.text_parts)
                del self._samples[out.request_id]
        for parent, deltas, prompt_logprobs in touched.values():
            request_output = parent.output
            request_output.finished = all(c.finished for c in request_output.outputs)
            if request_output.finished:
                del self._parents[request_output.request_id]
            result.request_outputs.append(request_output)
            result.deltas.append(RequestDelta(
                request_output.request_id, tuple(deltas), request_output.finished,
                first=not parent.delivered, prompt_token_ids=request_output.prompt_token_ids,
                num_cached_tokens=request_output.num_cached_tokens,
                prompt_logprobs=tuple(prompt_logprobs)))
            parent.delivered = True
        return result

    def _apply(self, sample: _Sample, out: EngineCoreOutput, now: float
               ) -> tuple[CompletionDelta, bool]:
        comp, metrics = sample.completion, sample.metrics
        parent = sample.parent
        if not parent.seen_first:
            parent.seen_first = True
            parent.output.num_cached_tokens = out.num_cached_tokens
        if comp.index == 0 and out.new_prompt_logprobs is not None:
            # Every sample scores the same prompt; the first sample's scores are kept.
            if parent.output.prompt_logprobs is None:
                parent.output.prompt_logprobs = list(out.new_prompt_logprobs)
            else:
                parent.output.prompt_logprobs.extend(out.new_prompt_logprobs)
        for event in out.events or ():
            if event.type is EngineCoreEventType.SCHEDULED and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = event.timestamp
        new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
        stopped = False
        text = ""
        if sample.detok is not None:
            text = sample.detok.update(new_ids, finished=out.finished)
            sample.text_parts.append(text)
            cut = sample.detok.stop_string is not None and sample.detok.consumed < len(new_ids)
            if cut:
                # A step that brought several tokens (a decode burst, accepted
                # drafts) ends at the one that completed the stop string.
                new_ids = new_ids[:sample.detok.consumed]
                new_logprobs = new_logprobs[:len(new_ids)] if new_logprobs else new_logprobs
            if sample.detok.stop_string is not None and (cut or not out.finished):
                comp.finish, comp.stop_reason = FinishReason.STOP, sample.detok.stop_string
                stopped = True
        comp.token_ids.extend(new_ids)
        if new_ids:
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            metrics.token_times.extend([now] * len(new_ids))
        kept_logprobs = tuple(new_logprobs or ()) if comp.logprobs is not None else ()
        if comp.logprobs is not None:
            comp.logprobs.extend(kept_logprobs)
        comp.num_draft_tokens += out.num_draft_tokens
        comp.num_accepted_tokens += out.num_accepted_tokens
        if out.finished and comp.finish is None:
            comp.finish = out.finish_reason
            comp.stop_reason = out.stop_reason
        if comp.finished:
            metrics.finished_time = now
        delta = CompletionDelta(
            comp.index, tuple(new_ids), text, kept_logprobs, tuple(out.events or ()),
            len(comp.token_ids), out.num_draft_tokens, out.num_accepted_tokens, comp.finish,
            comp.stop_reason)
        return delta, stopped

    def output_of(self, request_id: str) -> RequestOutput | None:
        """The cumulative output of a request still in flight."""
        parent = self._parents.get(request_id)
        return None if parent is None else parent.output

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent; returns the engine ids still to abort in the scheduler."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = [cid for cid, s in self._samples.items() if s.parent is parent]
        for cid in ids:
            del self._samples[cid]
        return ids
