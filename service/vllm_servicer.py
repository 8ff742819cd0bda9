"""`vllm.grpc.engine.VllmEngine` over the same engine as `esurge.v1.EngineService`.

Gateways built for vLLM workers (smg: OpenAI API, tokenization, chat
templates, cache-aware routing) talk to this server in vLLM's own protocol,
taken from the `smg-grpc-proto` package. The servicer is a thin front on
`EngineServicer`: the same bridge, admission limits, health phases and drain,
so one server answers both protocols and counts one set of requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpc
from google.rpc import status_pb2
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from esurge.engine.loop import EngineDeadError
from esurge.engine.request_output import CompletionDelta, RequestDelta
from esurge.outputs import TokenLogprobs
from service import info
from service.admission import new_request_id, submit_or_status
from service.bridge import BridgeItem, EngineBridge, drain
from service.convert import GenerationRequest
from service.errors import (
    FieldViolation,
    InvalidFieldError,
    abort_with_status,
    field_violations,
    internal,
)
from service.errors import invalid_argument as invalid_argument_status
from service.health import Phase
from service.kv_events import kv_event_stream
from service.servicer import EngineServicer
from service.tokenizer_bundle import CHUNK_BYTES, TokenizerBundle
from service.vllm_convert import (
    default_sampling_json,
    input_logprobs,
    output_logprobs,
    request_from_vllm,
    vllm_field_path,
)

__all__ = ["SERVICE_NAME", "VllmEngineServicer"]

SERVICE_NAME: str = vllm_pb2.DESCRIPTOR.services_by_name["VllmEngine"].full_name

# Our EngineRequest field paths -> the protocol's, for engine refusals.
_PROMPT_PATHS = {"prompt_token_ids": "tokenized.input_ids", "prompt_text": "text",
                 "request_id": "request_id", "sampling_params": "sampling_params"}


def _protocol_path(path: str) -> str:
    if path.startswith("sampling_params."):
        return vllm_field_path(path.removeprefix("sampling_params."))
    return _PROMPT_PATHS.get(path, path)


@dataclass(slots=True)
class _Sample:
    """What one sample of a request has produced so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    started: bool = False


@dataclass(slots=True)
class _Request:
    """One Generate call's state: the samples, the prompt and its logprobs."""

    gen: GenerationRequest
    stream: bool
    prompt_ids: tuple[int, ...] = ()
    cached: int = 0
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    samples: dict[int, _Sample] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.gen.sampling_params.n

    def _counts(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt_ids), "cached_tokens": self.cached}

    def chunk(self, delta: CompletionDelta, sample: _Sample) -> vllm_pb2.GenerateResponse:
        params = self.gen.sampling_params
        first = not sample.started
        sample.started = True
        return vllm_pb2.GenerateResponse(chunk=vllm_pb2.GenerateStreamChunk(
            token_ids=delta.token_ids, completion_tokens=len(delta.token_ids), index=delta.index,
            output_logprobs=output_logprobs(delta.logprobs, params.logprobs),
            input_logprobs=(input_logprobs(self.prompt_ids, self.prompt_logprobs,
                                           params.prompt_logprobs) if first else None),
            **self._counts()))

    def complete(self, index: int, tokens: list[int], entries: list[TokenLogprobs],
                 reason: str, stop: int | str | None) -> vllm_pb2.GenerateResponse:
        params = self.gen.sampling_params
        msg = vllm_pb2.GenerateComplete(
            output_ids=tokens, finish_reason=reason, completion_tokens=len(tokens), index=index,
            output_logprobs=output_logprobs(entries, params.logprobs),
            input_logprobs=input_logprobs(self.prompt_ids, self.prompt_logprobs,
                                          params.prompt_logprobs),
            **self._counts())
        if isinstance(stop, int):
            msg.matched_token_id = stop
        elif isinstance(stop, str):
            msg.matched_stop_str = stop
        return vllm_pb2.GenerateResponse(complete=msg)

    def messages(self, item: RequestDelta) -> list[vllm_pb2.GenerateResponse]:
        """The protocol's messages for one engine step of this request."""
        if item.first:
            self.prompt_ids, self.cached = tuple(item.prompt_token_ids), item.num_cached_tokens
        self.prompt_logprobs.extend(item.prompt_logprobs)
        out = []
        for delta in item.outputs:
            sample = self.samples.setdefault(delta.index, _Sample())
            sample.token_ids.extend(delta.token_ids)
            sample.logprobs.extend(delta.logprobs)
            if self.stream and (delta.token_ids or delta.finished):
                out.append(self.chunk(delta, sample))
            if delta.finished:
                self.finished.add(delta.index)
                # Streaming: the last delta again (the gateway sums the chunks), as vLLM's
                # servicer sends it; otherwise the whole sample.
                tokens, entries = ((list(delta.token_ids), list(delta.logprobs)) if self.stream
                                   else (sample.token_ids, sample.logprobs))
                out.append(self.complete(delta.index, tokens, entries,
                                         str(delta.finish), delta.stop_reason))
        return out

    def aborted(self) -> list[vllm_pb2.GenerateResponse]:
        """Completes with finish_reason "abort" for every sample still running."""
        out = []
        for index in range(self.gen.sampling_params.n):
            if index not in self.finished:
                self.finished.add(index)
                out.append(self.complete(index, [], [], "abort", None))
        return out


class VllmEngineServicer(vllm_grpc.VllmEngineServicer):
    """The vLLM protocol on `core`'s engine, admission and health."""

    def __init__(self, core: EngineServicer) -> None:
        self.core = core
        self._started = time.time()
        self._last_request = 0.0
        self._tokenizer: TokenizerBundle | None = None
        self._throughput = (time.monotonic(), 0)

    async def Generate(self, request: vllm_pb2.GenerateRequest,
                       context: Any) -> AsyncIterator[vllm_pb2.GenerateResponse]:
        """Run one request; stream chunks then completes, or completes only."""
        self._last_request = time.time()
        async with self.core._admitted(context) as bridge:
            state, request_id, sink = await self._start(bridge, request, context)
            try:
                while not state.done:
                    for _, item in await drain(sink):
                        for msg in await self._messages(state, item, context):
                            yield msg
            finally:
                if not state.done:
                    bridge.abort(request_id)

    async def _start(self, bridge: EngineBridge, request: vllm_pb2.GenerateRequest,
                     context: Any
                     ) -> tuple[_Request, str, asyncio.Queue[tuple[str, BridgeItem]]]:
        max_len = bridge.engine.config.scheduler_config.max_model_len
        try:
            gen = request_from_vllm(request, max_len)
        except InvalidFieldError as err:
            await abort_with_status(context, invalid_argument_status(err.violations))
        overload = self.core.policy.refusal(bridge)
        if overload is not None:
            await abort_with_status(context, overload)
        request_id = request.request_id or new_request_id()
        sink: asyncio.Queue[tuple[str, BridgeItem]] = asyncio.Queue()
        status = await submit_or_status(bridge, gen, request_id, sink, "")
        if status is not None:
            await abort_with_status(context, _in_protocol_terms(status))
        return _Request(gen, request.stream), request_id, sink

    @staticmethod
    async def _messages(state: _Request, item: BridgeItem, context: Any
                        ) -> list[vllm_pb2.GenerateResponse]:
        if isinstance(item, EngineDeadError):
            await abort_with_status(context, internal(f"the engine failed: {item}"))
        if isinstance(item, RequestDelta):
            return state.messages(item)
        return state.aborted()

    async def Abort(self, request: vllm_pb2.AbortRequest,
                    context: Any) -> vllm_pb2.AbortResponse:
        """Abort requests by id (unknown and finished ids are skipped)."""
        bridge = await self.core._bridge_or_abort(context)
        for request_id in set(request.request_ids):
            bridge.abort(request_id)
        return vllm_pb2.AbortResponse()

    async def HealthCheck(self, request: vllm_pb2.HealthCheckRequest,
                          context: Any) -> vllm_pb2.HealthCheckResponse:
        """Healthy while the engine serves (not while warming up, draining or failed)."""
        failure = self.core.engine_failure()
        phase = self.core.state.phase
        healthy = failure is None and phase is Phase.SERVING and self.core.bridge is not None
        message = "healthy" if healthy else (failure or f"the server is {phase.name.lower()}")
        return vllm_pb2.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(self, request: vllm_pb2.GetModelInfoRequest,
                           context: Any) -> vllm_pb2.GetModelInfoResponse:
        """The served model, in the protocol's terms."""
        engine = (await self.core._bridge_or_abort(context)).engine
        model, ours = engine.model, info.model_info(engine)
        special = ours.special_token_ids
        return vllm_pb2.GetModelInfoResponse(
            model_path=str(model.model_dir), is_generation=True,
            max_context_length=ours.max_model_len, vocab_size=ours.vocab_size,
            supports_vision=False, served_model_name=ours.model_name, tokenizer_path="",
            model_type=ours.model_type, architectures=[ours.architecture],
            eos_token_ids=list(special.eos_token_ids),
            pad_token_id=special.pad_token_id if special.HasField("pad_token_id") else -1,
            bos_token_id=special.bos_token_id if special.HasField("bos_token_id") else -1,
            max_req_input_len=ours.max_model_len,
            default_sampling_params_json=default_sampling_json())

    async def GetServerInfo(self, request: vllm_pb2.GetServerInfoRequest,
                            context: Any) -> vllm_pb2.GetServerInfoResponse:
        """What the gateway labels the worker with."""
        engine = (await self.core._bridge_or_abort(context)).engine
        stats, config = engine.stats, engine.config
        return vllm_pb2.GetServerInfoResponse(
            active_requests=stats.num_running + stats.num_waiting,
            last_receive_timestamp=self._last_request, uptime_seconds=time.time() - self._started,
            # The protocol's name for a worker that speaks it; GetServerInfo of
            # esurge.v1 says what this server is.
            server_type="vllm-grpc", data_parallel_size=1, kv_cache_dtype="auto",
            block_size=config.cache_config.page_size, model_dtype=engine.model.dtype,
            max_num_seqs=config.scheduler_config.max_num_seqs)

    async def GetLoads(self, request: vllm_pb2.GetLoadsRequest,
                       context: Any) -> vllm_pb2.GetLoadsResponse:
        """One rank's load, from the stats the engine loop last published."""
        engine = (await self.core._bridge_or_abort(context)).engine
        stats, max_seqs = engine.stats, engine.config.scheduler_config.max_num_seqs
        before, tokens_before = self._throughput
        elapsed = stats.timestamp - before
        rate = (stats.num_generation_tokens - tokens_before) / elapsed if elapsed > 0 else 0.0
        self._throughput = (stats.timestamp, stats.num_generation_tokens)
        used = (stats.num_usable_pages - stats.num_free_pages) * stats.page_size
        load = vllm_pb2.SchedulerLoad(
            dp_rank=0, num_running_reqs=stats.num_running, num_waiting_reqs=stats.num_waiting,
            num_total_reqs=stats.num_running + stats.num_waiting, num_used_tokens=used,
            max_total_num_tokens=stats.num_usable_pages * stats.page_size,
            token_usage=stats.kv_cache_usage, gen_throughput=max(rate, 0.0),
            cache_hit_rate=stats.prefix_cache_hit_rate,
            utilization=stats.num_running / max_seqs, max_running_requests=max_seqs)
        return vllm_pb2.GetLoadsResponse(timestamp=datetime.now(UTC).isoformat(),
                                         version=info.server_version(), dp_rank_count=1,
                                         loads=[load])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: Any) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer files as a zip, in chunks; the last carries its sha256."""
        engine = (await self.core._bridge_or_abort(context)).engine
        if self._tokenizer is None:
            self._tokenizer = TokenizerBundle(engine)
        try:
            data, digest = await self._tokenizer.get()
        except FileNotFoundError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        for start in range(0, len(data), CHUNK_BYTES):
            last = start + CHUNK_BYTES >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start:start + CHUNK_BYTES],
                                               sha256=digest if last else "")

    async def _unimplemented(self, context: Any, what: str) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, what)

    async def Embed(self, request: Any, context: Any) -> Any:
        """Not offered: this server runs generative models only."""
        return await self._unimplemented(context, "this server runs generative models only")

    async def FlushCache(self, request: Any, context: Any) -> Any:
        """Not offered yet."""
        return await self._unimplemented(context, "flushing the prefix cache is not offered")

    async def StartProfile(self, request: Any, context: Any) -> Any:
        """Not offered."""
        return await self._unimplemented(context, "profiling is not offered")

    async def StopProfile(self, request: Any, context: Any) -> Any:
        """Not offered."""
        return await self._unimplemented(context, "profiling is not offered")

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: Any) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's stores and evictions as they happen (until the client leaves)."""
        engine = (await self.core._bridge_or_abort(context)).engine
        async for batch in kv_event_stream(engine, request.start_sequence_number,
                                           request.load_records_before_first_batch):
            yield batch


def _in_protocol_terms(status: status_pb2.Status) -> status_pb2.Status:
    """An engine refusal with its field paths in the protocol's names, in its
    details and its message alike."""
    violations = field_violations(status)
    if not violations:
        return status
    return invalid_argument_status([FieldViolation(_protocol_path(v.field), v.description)
                                    for v in violations])

