"""A typed Python client for `esurge.v1.EngineService`, blocking and asyncio.

    with EngineClient("127.0.0.1:50051") as client:
        for message in client.generate("def add(a, b):", SamplingParams(max_tokens=32)):
            print(message.text, end="", flush=True)

    async with AsyncEngineClient("127.0.0.1:50051") as client:
        async for message in client.generate([1, 42, 7]):
            ...

Failures raise `grpc.RpcError` (`grpc.aio.AioRpcError`); read the rich status
(field violations, retry delay) with `service.errors.status_from_rpc_error`.
This module imports no JAX: it only needs the protos and the engine's
pure-Python SamplingParams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from esurge.engine.chat import ChatPrompt
from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2, sampling_pb2, service_pb2, service_pb2_grpc
from service.convert import chat_to_proto, sampling_params_to_proto

__all__ = [
    "AsyncEngineClient",
    "EngineClient",
    "ResponseStream",
    "build_request",
    "channel_credentials",
]

T = TypeVar("T", covariant=True)
# Text, token ids, or a conversation for the server's chat template.
Prompt = str | Sequence[int] | ChatPrompt
Metadata = Sequence[tuple[str, str]]


class ResponseStream(Iterator[T], Protocol[T]):
    """A server stream of a blocking client: iterate it; cancel() ends it early."""

    def cancel(self) -> bool:
        """Cancel the call (the server aborts its requests)."""

    def initial_metadata(self) -> Any:
        """The server's initial metadata (x-request-id among it)."""


def _read(path: str | Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


def channel_credentials(ca: str | Path | None = None, cert: str | Path | None = None,
                        key: str | Path | None = None) -> grpc.ChannelCredentials:
    """TLS credentials from PEM files: the CA to trust (None: the system's), and a
    client certificate and key for mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError(f"cert and key must be given together, got cert={cert!r}, key={key!r}")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


def build_request(prompt: Prompt,
                  params: SamplingParams | sampling_pb2.SamplingParams | None = None, *,
                  request_id: str | None = None, priority: int = 0,
                  cache_salt: str | None = None, return_text: bool = True,
                  return_prompt_token_ids: bool = False,
                  return_events: bool = False) -> engine_pb2.EngineRequest:
    """An EngineRequest: prompt text, token ids or a chat, sampling options, hints.

    `params` None leaves every sampling option at the server's default.
    """
    msg = engine_pb2.EngineRequest(
        request_id=request_id or "", priority=priority, cache_salt=cache_salt or "",
        output_options=engine_pb2.OutputOptions(
            return_text=return_text, return_prompt_token_ids=return_prompt_token_ids,
            return_events=return_events))
    if isinstance(prompt, ChatPrompt):
        msg.chat.CopyFrom(chat_to_proto(prompt))
    elif isinstance(prompt, str):
        msg.prompt_text = prompt
    else:
        msg.prompt_token_ids.token_ids.extend(int(t) for t in prompt)
    if isinstance(params, SamplingParams):
        msg.sampling_params.CopyFrom(sampling_params_to_proto(params))
    elif params is not None:
        msg.sampling_params.CopyFrom(params)
    return msg


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


class _ClientBase:
    """What both clients share: the target and the channel settings."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None,
                 max_message_bytes: int, timeout: float | None) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be None or > 0 seconds, got {timeout!r}")
        self.target = target
        self.timeout = timeout
        self._credentials = credentials
        self._options = _channel_options(max_message_bytes)

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _attach(self, channel: Any) -> None:
        """Stubs over a sync or asyncio channel (the generated stubs take either)."""
        self.channel = channel
        self.stub = service_pb2_grpc.EngineServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)

    @staticmethod
    def _request(prompt: Prompt | engine_pb2.EngineRequest,
                 params: SamplingParams | sampling_pb2.SamplingParams | None,
                 options: dict[str, Any]) -> engine_pb2.EngineRequest:
        """A ready EngineRequest as given, or one built by build_request."""
        if isinstance(prompt, engine_pb2.EngineRequest):
            return prompt
        return build_request(prompt, params, **options)


class EngineClient(_ClientBase):
    """Blocking client. `timeout` is the default deadline of every call, in seconds."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = 16 * 1024 * 1024, timeout: float | None = None
                 ) -> None:
        super().__init__(target, credentials, max_message_bytes, timeout)
        self._attach(grpc.secure_channel(target, credentials, self._options) if credentials
                     else grpc.insecure_channel(target, self._options))

    def generate(self, prompt: Prompt | engine_pb2.EngineRequest,
                 params: SamplingParams | sampling_pb2.SamplingParams | None = None, *,
                 timeout: float | None = None, metadata: Metadata | None = None,
                 **options: Any) -> ResponseStream[service_pb2.GenerateResponse]:
        """Stream a generation; `options` are build_request's keywords."""
        request = self._request(prompt, params, options)
        stream: ResponseStream[service_pb2.GenerateResponse] = self.stub.Generate(
            service_pb2.GenerateRequest(request=request), timeout=self._timeout(timeout),
            metadata=metadata)
        return stream

    def generate_unary(self, prompt: Prompt | engine_pb2.EngineRequest,
                       params: SamplingParams | sampling_pb2.SamplingParams | None = None, *,
                       timeout: float | None = None, metadata: Metadata | None = None,
                       **options: Any) -> service_pb2.GenerateUnaryResponse:
        """Generate to completion in one call."""
        request = self._request(prompt, params, options)
        response: service_pb2.GenerateUnaryResponse = self.stub.GenerateUnary(
            service_pb2.GenerateUnaryRequest(request=request), timeout=self._timeout(timeout),
            metadata=metadata)
        return response

    def engine_stream(self, messages: Iterable[service_pb2.EngineStreamRequest], *,
                      timeout: float | None = None
                      ) -> ResponseStream[service_pb2.EngineStreamResponse]:
        """Many requests over one stream (see EngineStreamRequest)."""
        stream: ResponseStream[service_pb2.EngineStreamResponse] = self.stub.EngineStream(
            iter(messages), timeout=self._timeout(timeout))
        return stream

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests; returns the ids that were in flight."""
        response = self.stub.Abort(service_pb2.AbortRequest(request_ids=list(request_ids)),
                                   timeout=self.timeout)
        return list(response.aborted_request_ids)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        response = self.stub.Tokenize(service_pb2.TokenizeRequest(
            text=text, add_special_tokens=add_special_tokens), timeout=self.timeout)
        return list(response.token_ids)

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        response = self.stub.Detokenize(service_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens), timeout=self.timeout)
        return str(response.text)

    def model_info(self) -> service_pb2.GetModelInfoResponse:
        """The served model's description."""
        response: service_pb2.GetModelInfoResponse = self.stub.GetModelInfo(
            service_pb2.GetModelInfoRequest(), timeout=self.timeout)
        return response

    def server_info(self) -> service_pb2.GetServerInfoResponse:
        """Versions and configuration."""
        response: service_pb2.GetServerInfoResponse = self.stub.GetServerInfo(
            service_pb2.GetServerInfoRequest(), timeout=self.timeout)
        return response

    def load(self) -> service_pb2.GetLoadResponse:
        """Current load."""
        response: service_pb2.GetLoadResponse = self.stub.GetLoad(
            service_pb2.GetLoadRequest(), timeout=self.timeout)
        return response

    def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name of `service` ("" is the whole server)."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=self.timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncEngineClient(_ClientBase):
    """asyncio client (grpc.aio); the same calls as EngineClient, awaited."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 max_message_bytes: int = 16 * 1024 * 1024, timeout: float | None = None
                 ) -> None:
        super().__init__(target, credentials, max_message_bytes, timeout)
        self._attach(grpc.aio.secure_channel(target, credentials, self._options)
                     if credentials else grpc.aio.insecure_channel(target, self._options))

    def generate(self, prompt: Prompt | engine_pb2.EngineRequest,
                 params: SamplingParams | sampling_pb2.SamplingParams | None = None, *,
                 timeout: float | None = None, metadata: Metadata | None = None,
                 **options: Any) -> Any:
        """Stream a generation: `async for` over the returned call; `.cancel()` ends it."""
        request = self._request(prompt, params, options)
        return self.stub.Generate(service_pb2.GenerateRequest(request=request),
                                  timeout=self._timeout(timeout), metadata=metadata)

    async def generate_unary(self, prompt: Prompt | engine_pb2.EngineRequest,
                             params: SamplingParams | sampling_pb2.SamplingParams | None = None,
                             *, timeout: float | None = None, metadata: Metadata | None = None,
                             **options: Any) -> service_pb2.GenerateUnaryResponse:
        """Generate to completion in one call."""
        request = self._request(prompt, params, options)
        response: service_pb2.GenerateUnaryResponse = await self.stub.GenerateUnary(
            service_pb2.GenerateUnaryRequest(request=request), timeout=self._timeout(timeout),
            metadata=metadata)
        return response

    def engine_stream(self, messages: AsyncIterator[service_pb2.EngineStreamRequest]
                      | Iterable[service_pb2.EngineStreamRequest] | None = None, *,
                      timeout: float | None = None) -> Any:
        """Many requests over one stream. Without `messages`, send with
        `await call.write(...)` and end with `await call.done_writing()`."""
        return self.stub.EngineStream(messages, timeout=self._timeout(timeout))

    async def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests; returns the ids that were in flight."""
        response = await self.stub.Abort(
            service_pb2.AbortRequest(request_ids=list(request_ids)), timeout=self.timeout)
        return list(response.aborted_request_ids)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        response = await self.stub.Tokenize(service_pb2.TokenizeRequest(
            text=text, add_special_tokens=add_special_tokens), timeout=self.timeout)
        return list(response.token_ids)

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool = True
                         ) -> str:
        """Text of `token_ids`."""
        response = await self.stub.Detokenize(service_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens), timeout=self.timeout)
        return str(response.text)

    async def model_info(self) -> service_pb2.GetModelInfoResponse:
        """The served model's description."""
        response: service_pb2.GetModelInfoResponse = await self.stub.GetModelInfo(
            service_pb2.GetModelInfoRequest(), timeout=self.timeout)
        return response

    async def server_info(self) -> service_pb2.GetServerInfoResponse:
        """Versions and configuration."""
        response: service_pb2.GetServerInfoResponse = await self.stub.GetServerInfo(
            service_pb2.GetServerInfoRequest(), timeout=self.timeout)
        return response

    async def load(self) -> service_pb2.GetLoadResponse:
        """Current load."""
        response: service_pb2.GetLoadResponse = await self.stub.GetLoad(
            service_pb2.GetLoadRequest(), timeout=self.timeout)
        return response

    async def health(self, service: str = "") -> str:
        """The grpc.health.v1 status name of `service` ("" is the whole server)."""
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self.timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
