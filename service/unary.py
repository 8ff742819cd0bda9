"""Gathering a whole request's output for GenerateUnary."""

from __future__ import annotations

from esurge.engine.request_output import RequestDelta
from generated.esurge.v1 import engine_pb2, service_pb2
from service.bridge import Aborted
from service.convert import set_stop_reason
from service.responses import RequestCursor

__all__ = ["UnaryCollector"]


class UnaryCollector:
    """Accumulates a request's deltas into complete samples."""

    def __init__(self, cursor: RequestCursor) -> None:
        self.cursor = cursor
        self.completions = [service_pb2.Completion(index=i) for i in range(cursor.n)]
        self.prompt_logprobs: list[engine_pb2.PositionLogprobs] = []

    @property
    def finished(self) -> bool:
        """True once every sample has ended."""
        return self.cursor.finished

    def add(self, item: RequestDelta | Aborted) -> None:
        """Take in one step's delta, or the request's abort."""
        cursor = self.cursor
        deltas = cursor.abort_remaining() if isinstance(item, Aborted) else cursor.advance(item)
        self.prompt_logprobs.extend(cursor.take_prompt_logprobs())
        for delta in deltas:
            completion = self.completions[delta.index]
            completion.token_ids.extend(delta.token_ids)
            completion.text += delta.text
            completion.logprobs.extend(delta.logprobs)
            completion.events.extend(delta.events)
            if delta.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                completion.finish_reason = delta.finish_reason
                set_stop_reason(completion, delta.stop_reason)

    def response(self, with_prompt_ids: bool) -> service_pb2.GenerateUnaryResponse:
        """The answer: every sample, prompt info and summed usage."""
        cursor = self.cursor
        totals = [cursor.sample_totals(c.index) for c in self.completions]
        usage = cursor.usage(sum(len(c.token_ids) for c in self.completions),
                             sum(t[0] for t in totals), sum(t[1] for t in totals))
        return service_pb2.GenerateUnaryResponse(
            request_id=cursor.request_id, prompt_info=cursor.prompt_info(with_prompt_ids),
            completions=self.completions, prompt_logprobs=self.prompt_logprobs, usage=usage)
