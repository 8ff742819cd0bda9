"""The `esurge.v1.EngineService` servicer: converts, delegates to the engine, streams.

Every generation call validates its request (`service.convert`, then the
engine's own checks), submits it through the `EngineBridge`, and turns the
engine's per-step deltas into response messages (`service.responses`). A
call that ends early, by client cancel or deadline, aborts its request in
the engine, which frees its pages at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from esurge.engine.loop import EngineDeadError
from esurge.engine.request_output import RequestDelta
from esurge.engine.tokenize import decode_ids, encode_ids
from generated.esurge.v1 import service_pb2, service_pb2_grpc
from service import info
from service.admission import (
    REQUEST_ID_METADATA,
    AdmissionPolicy,
    check_request_id,
    metadata_request_id,
    new_request_id,
    parse_request,
    submit_or_status,
)
from service.bridge import BridgeItem, EngineBridge, drain
from service.convert import GenerationRequest
from service.engine_stream import EngineStreamSession
from service.errors import (
    FieldViolation,
    InvalidFieldError,
    abort_with_status,
    internal,
    invalid_argument,
    unavailable,
)
from service.health import Phase, ServingState
from service.responses import RequestCursor, SampleDelta, coalesce
from service.unary import UnaryCollector

if TYPE_CHECKING:
    from esurge.engine.api import eSurge
    from generated.esurge.v1 import engine_pb2

__all__ = ["EngineServicer"]

log = logging.getLogger(__name__)


class EngineServicer(service_pb2_grpc.EngineServiceServicer):
    """Serves one eSurge engine; `attach` it once it has warmed up."""

    def __init__(self, state: ServingState, policy: AdmissionPolicy | None = None) -> None:
        self.state = state
        self.policy = policy or AdmissionPolicy()
        self._bridge: EngineBridge | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def attach(self, engine: eSurge) -> None:
        """Start serving `engine`; call on the server's event loop."""
        if self._bridge is not None:
            raise ValueError("an engine is already attached to this servicer")
        self._bridge = EngineBridge(engine, asyncio.get_running_loop(), self._engine_died)

    @property
    def bridge(self) -> EngineBridge | None:
        """The bridge to the attached engine (None while warming up)."""
        return self._bridge

    def engine_failure(self) -> str | None:
        """Why the attached engine cannot serve any more; None while it can."""
        bridge = self._bridge
        if bridge is None or self.state.phase is Phase.DRAINING:
            return None  # a draining server stops its engine on purpose
        loop = bridge.engine.loop
        if loop.error is not None:
            return f"the engine loop failed: {loop.error!r}"
        return None if loop.alive else "the engine loop has stopped"

    def check_engine(self) -> None:
        """Notice an engine that died while idle (health goes NOT_SERVING)."""
        reason = self.engine_failure()
        if reason is not None:
            self._engine_died(EngineDeadError(reason))

    def _engine_died(self, error: EngineDeadError) -> None:
        if self.state.phase in (Phase.FAILED, Phase.DRAINING):
            return
        log.error("the engine died: %s", error)
        task = asyncio.get_running_loop().create_task(self.state.mark_failed(str(error)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- call admission ------------------------------------------------------

    async def _bridge_or_abort(self, context: Any) -> EngineBridge:
        """The bridge to a live engine, or the call ends UNAVAILABLE / INTERNAL."""
        if self._bridge is None:
            await abort_with_status(context, unavailable(
                "the server is warming up its engine", 5.0, reason="WARMING_UP"))
        failure = self.engine_failure()
        if failure is not None:
            self._engine_died(EngineDeadError(failure))
            await abort_with_status(context, internal(failure))
        return self._bridge

    @contextlib.asynccontextmanager
    async def _admitted(self, context: Any) -> AsyncIterator[EngineBridge]:
        """Admit a call that creates work: refused while starting, draining or failed."""
        bridge = await self._bridge_or_abort(context)
        refusal = self.state.refusal()
        if refusal is not None:
            await abort_with_status(context, refusal)
        with self.state.track_call():
            yield bridge

    async def _start(self, bridge: EngineBridge, msg: engine_pb2.EngineRequest,
                     context: Any
                     ) -> tuple[GenerationRequest, str, asyncio.Queue[tuple[str, BridgeItem]]]:
        """Validate, name, admit and submit a Generate / GenerateUnary request."""
        try:
            request = parse_request(msg, "request")
            request_id = request.request_id or metadata_request_id(
                context.invocation_metadata())
            if request_id is not None and request.request_id is None:
                check_request_id(request_id, "request.request_id",
                                 f"{REQUEST_ID_METADATA} metadata")
        except InvalidFieldError as err:
            await abort_with_status(context, invalid_argument(err.violations))
        request_id = request_id or new_request_id()
        await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
        overload = self.policy.refusal(bridge)
        if overload is not None:
            await abort_with_status(context, overload)
        sink: asyncio.Queue[tuple[str, BridgeItem]] = asyncio.Queue()
        status = await submit_or_status(bridge, request, request_id, sink, "request")
        if status is not None:
            await abort_with_status(context, status)
        return request, request_id, sink

    # ---- generation ----------------------------------------------------------

    async def Generate(self, request: service_pb2.GenerateRequest,
                       context: Any) -> AsyncIterator[service_pb2.GenerateResponse]:
        """Stream one request's output: prompt info, token deltas, finish and usage."""
        async with self._admitted(context) as bridge:
            gen, request_id, sink = await self._start(bridge, request.request, context)
            cursor = RequestCursor(request_id, gen.sampling_params.n, gen.return_text,
                                   gen.return_events)
            try:
                while not cursor.finished:
                    items = [item for _, item in await drain(sink)]
                    for msg in await self._stream_messages(cursor, items, gen, context):
                        yield msg
            finally:
                if not cursor.finished:
                    bridge.abort(request_id)

    async def _stream_messages(self, cursor: RequestCursor, items: list[BridgeItem],
                               gen: GenerationRequest, context: Any
                               ) -> list[service_pb2.GenerateResponse]:
        """The messages for what arrived since the last send: one per sample.

        Prompt logprobs ride on the first message; those of a prefill chunk
        that sends none wait in the cursor for the next one.
        """
        parts: list[SampleDelta] = []
        for item in items:
            if isinstance(item, EngineDeadError):
                await abort_with_status(context, internal(f"the engine failed: {item}"))
            if isinstance(item, RequestDelta):
                parts.extend(cursor.advance(item))
            else:
                parts.extend(cursor.abort_remaining())
        messages = [cursor.generate_response(d, with_prompt_ids=gen.return_prompt_token_ids,
                                             total_drafts=cursor.sample_totals(d.index))
                    for d in coalesce(parts)]
        if messages and (pending := cursor.take_prompt_logprobs()):
            messages[0].prompt_logprobs.extend(pending)
        return messages

    async def GenerateUnary(self, request: service_pb2.GenerateUnaryRequest,
                            context: Any) -> service_pb2.GenerateUnaryResponse:
        """Run one request to completion and answer once."""
        async with self._admitted(context) as bridge:
            gen, request_id, sink = await self._start(bridge, request.request, context)
            collector = UnaryCollector(RequestCursor(
                request_id, gen.sampling_params.n, gen.return_text, gen.return_events))
            try:
                while not collector.finished:
                    for _, item in await drain(sink):
                        if isinstance(item, EngineDeadError):
                            await abort_with_status(context, internal(
                                f"the engine failed: {item}"))
                        collector.add(item)
            finally:
                if not collector.finished:
                    bridge.abort(request_id)
            return collector.response(gen.return_prompt_token_ids)

    async def EngineStream(self, request_iterator: AsyncIterator[service_pb2.EngineStreamRequest],
                           context: Any) -> AsyncIterator[service_pb2.EngineStreamResponse]:
        """Many requests over one stream, outputs multiplexed by request id."""
        async with self._admitted(context) as bridge:
            session = EngineStreamSession(bridge, self.policy, self.state)
            async for message in session.run(request_iterator):
                if isinstance(message, EngineDeadError):
                    await abort_with_status(context, internal(f"the engine failed: {message}"))
                yield message

    async def Abort(self, request: service_pb2.AbortRequest,
                    context: Any) -> service_pb2.AbortResponse:
        """Abort requests by id; unknown and finished ids are skipped."""
        bridge = await self._bridge_or_abort(context)
        aborted = sorted(rid for rid in set(request.request_ids) if bridge.abort(rid))
        return service_pb2.AbortResponse(aborted_request_ids=aborted)

    # ---- tokenizer -----------------------------------------------------------

    async def _tokenizer(self, context: Any) -> tuple[Any, int]:
        """The engine's tokenizer and the model's vocabulary size."""
        async with self._admitted(context) as bridge:
            tokenizer = bridge.engine.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the served model directory has no tokenizer.json")
        return tokenizer, bridge.engine.model.vocab_size

    async def Tokenize(self, request: service_pb2.TokenizeRequest,
                       context: Any) -> service_pb2.TokenizeResponse:
        """Token ids of a text."""
        tokenizer, _ = await self._tokenizer(context)
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = await asyncio.to_thread(encode_ids, tokenizer, request.text, special)
        return service_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: service_pb2.DetokenizeRequest,
                         context: Any) -> service_pb2.DetokenizeResponse:
        """Text of token ids; every id must be below the vocabulary size."""
        tokenizer, vocab = await self._tokenizer(context)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True

        def decode() -> str | list[FieldViolation]:
            # On the worker, not the event loop: millions of ids take 0.2 s to check.
            ids = list(request.token_ids)
            bad = [FieldViolation(f"token_ids[{i}]", f"token id {t} is not below the "
                                                     f"vocabulary size {vocab}")
                   for i, t in enumerate(ids) if t >= vocab]
            return bad[:10] if bad else decode_ids(tokenizer, ids, skip)

        text = await asyncio.to_thread(decode)
        if isinstance(text, list):
            await abort_with_status(context, invalid_argument(text))
        return service_pb2.DetokenizeResponse(text=text)

    # ---- descriptions --------------------------------------------------------

    async def GetModelInfo(self, request: service_pb2.GetModelInfoRequest,
                           context: Any) -> service_pb2.GetModelInfoResponse:
        """The served model's description."""
        bridge = await self._bridge_or_abort(context)
        return info.model_info(bridge.engine)

    async def GetServerInfo(self, request: service_pb2.GetServerInfoRequest,
                            context: Any) -> service_pb2.GetServerInfoResponse:
        """Versions and the configuration in effect."""
        bridge = await self._bridge_or_abort(context)
        return info.server_info(bridge.engine)

    async def GetLoad(self, request: service_pb2.GetLoadRequest,
                      context: Any) -> service_pb2.GetLoadResponse:
        """The engine's current load (also while draining)."""
        bridge = await self._bridge_or_abort(context)
        return info.load_info(bridge.engine.stats, self.state.phase is Phase.DRAINING)
