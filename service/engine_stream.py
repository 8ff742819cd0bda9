"""One EngineStream call: many requests in, per-step outputs out, by request id.

A reader task takes the client's messages (add a request, abort some) and
starts each request in its own task, so that many requests wait for the
engine's acceptance at once instead of one per engine step. All of the
stream's requests share one queue; the writer takes what has arrived and
sends it as one `EngineCoreOutputs`. A bad request gets a `RequestRejection`
and the stream goes on; closing the stream (or cancelling it) aborts the
requests it started.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from esurge.engine.loop import EngineDeadError
from esurge.engine.request_output import RequestDelta
from generated.esurge.v1 import engine_pb2, service_pb2
from service.admission import parse_request, submit_or_status
from service.bridge import BridgeItem, drain
from service.errors import (
    FieldViolation,
    InvalidFieldError,
    invalid_argument,
    rejection_from_status,
)
from service.responses import RequestCursor
from service.wire import Undecodable, undecodable_status

if TYPE_CHECKING:
    from google.rpc import status_pb2

    from service.admission import AdmissionPolicy
    from service.bridge import EngineBridge
    from service.health import ServingState

__all__ = ["EngineStreamSession"]


@dataclass(frozen=True, slots=True)
class _InputClosed:
    """The client half-closed the stream: no more requests will come."""


@dataclass(frozen=True, slots=True)
class _Draining:
    """The server began draining: the stream ends once its requests are done."""


_StreamItem = BridgeItem | service_pb2.RequestRejection | _InputClosed | _Draining


class EngineStreamSession:
    """The state of one EngineStream call."""

    def __init__(self, bridge: EngineBridge, policy: AdmissionPolicy,
                 state: ServingState) -> None:
        self._bridge = bridge
        self._policy = policy
        self._state = state
        self._queue: asyncio.Queue[tuple[str, _StreamItem]] = asyncio.Queue()
        self._cursors: dict[str, RequestCursor] = {}
        self._starting: set[asyncio.Task[None]] = set()
        self._input_done = False
        self._draining = False

    async def run(self, requests: AsyncIterator[service_pb2.EngineStreamRequest]
                  ) -> AsyncIterator[service_pb2.EngineStreamResponse | EngineDeadError]:
        """Serve the call; yields responses, or an EngineDeadError to end it with."""
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            with self._state.on_drain(lambda: self._queue.put_nowait(("", _Draining()))):
                while not self._done():
                    for message in self._responses(await drain(self._queue)):
                        yield message
                        if isinstance(message, EngineDeadError):
                            return
            if self._input_done:
                await reader  # surfaces a failure of the reader
        finally:
            reader.cancel()
            for task in list(self._starting):
                task.cancel()
            for request_id in list(self._cursors):
                self._bridge.abort(request_id)

    def _done(self) -> bool:
        # While draining, new requests are refused, so the stream can end as
        # soon as the ones it runs have finished, even if the client keeps it open.
        return ((self._input_done or self._draining) and not self._cursors
                and not self._starting and self._queue.empty())

    def _responses(self, items: list[tuple[str, _StreamItem]]
                   ) -> list[service_pb2.EngineStreamResponse | EngineDeadError]:
        out: list[service_pb2.EngineStreamResponse | EngineDeadError] = []
        step = engine_pb2.EngineCoreOutputs(engine_index=0, timestamp=time.monotonic())
        for request_id, item in items:
            if isinstance(item, _InputClosed):
                self._input_done = True
            elif isinstance(item, _Draining):
                self._draining = True
            elif isinstance(item, service_pb2.RequestRejection):
                out.append(service_pb2.EngineStreamResponse(rejection=item))
            elif isinstance(item, EngineDeadError):
                return [item]
            else:
                self._add_outputs(step, request_id, item)
        if step.outputs:
            step.finished_requests.sort()
            out.append(service_pb2.EngineStreamResponse(outputs=step))
        return out

    def _add_outputs(self, step: engine_pb2.EngineCoreOutputs, request_id: str,
                     item: BridgeItem) -> None:
        cursor = self._cursors.get(request_id)
        if cursor is None:
            return
        deltas = (cursor.advance(item) if isinstance(item, RequestDelta)
                  else cursor.abort_remaining())
        prompt_logprobs = cursor.take_prompt_logprobs() if deltas else []
        for delta in deltas:
            output = cursor.engine_core_output(delta)
            if prompt_logprobs:
                output.new_prompt_logprobs.extend(prompt_logprobs)
                prompt_logprobs = []
            step.outputs.append(output)
            if delta.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                step.finished_requests.append(output.request_id)
        if cursor.finished:
            del self._cursors[request_id]

    # ---- the client's side ---------------------------------------------------

    async def _read(self, requests: AsyncIterator[service_pb2.EngineStreamRequest]) -> None:
        try:
            async for message in requests:
                if isinstance(message, Undecodable):
                    self._reject("", undecodable_status(message))
                    continue
                action = message.WhichOneof("action")
                if action == "add_request":
                    task = asyncio.get_running_loop().create_task(
                        self._start(message.add_request))
                    self._starting.add(task)
                    task.add_done_callback(self._starting.discard)
                elif action == "abort":
                    for request_id in message.abort.request_ids:
                        if request_id in self._cursors:
                            self._bridge.abort(request_id)
                else:
                    self._reject("", invalid_argument([FieldViolation(
                        "action", "one of add_request or abort must be set")]))
        finally:
            self._queue.put_nowait(("", _InputClosed()))

    def _reject(self, request_id: str, status: status_pb2.Status) -> None:
        self._queue.put_nowait((request_id, rejection_from_status(request_id, status)))

    async def _start(self, msg: engine_pb2.EngineRequest) -> None:
        request_id = msg.request_id
        refusal = self._state.refusal()
        if refusal is not None:
            self._reject(request_id, refusal)
            return
        try:
            if not request_id:
                raise InvalidFieldError([FieldViolation(
                    "add_request.request_id", "request_id is required on an EngineStream")])
            request = parse_request(msg, "add_request")
        except InvalidFieldError as err:
            self._reject(request_id, invalid_argument(err.violations))
            return
        if request_id in self._cursors:
            self._reject(request_id, invalid_argument([FieldViolation(
                "add_request.request_id", f"request_id {request_id!r} is already in flight")]))
            return
        overload = self._policy.refusal(self._bridge)
        if overload is not None:
            self._reject(request_id, overload)
            return
        self._cursors[request_id] = RequestCursor(
            request_id, request.sampling_params.n, request.return_text, request.return_events)
        status = await submit_or_status(self._bridge, request, request_id, self._queue,
                                        "add_request")
        if status is not None:
            self._cursors.pop(request_id, None)
            self._reject(request_id, status)
