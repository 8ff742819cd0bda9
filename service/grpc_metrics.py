"""gRPC server metrics: calls started, handled (by status code) and their duration.

The names and labels of the Go and Python gRPC Prometheus middlewares
(`grpc_server_started_total`, `grpc_server_handled_total`,
`grpc_server_handling_seconds`, labelled `grpc_type`, `grpc_service`,
`grpc_method` and, once handled, `grpc_code`), so a mesh's existing gRPC
dashboards read this server too. An aio interceptor wraps every method's
behaviour, the health and reflection services included.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["GrpcServerMetrics"]

_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0, 300.0)


def _split(method: str) -> tuple[str, str]:
    """("esurge.v1.EngineService", "Generate") from "/esurge.v1.EngineService/Generate"."""
    service, _, name = method.lstrip("/").partition("/")
    return service, name


def _kind(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "bidi_stream" if handler.response_streaming else "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _code_of(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return "OK"
    return "CANCELLED" if isinstance(error, asyncio.CancelledError) else "UNKNOWN"


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every call the server handles."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter("grpc_server_started", "RPCs started on the server.", labels,
                               registry=registry)
        self.handled = Counter("grpc_server_handled", "RPCs completed, by status code.",
                               [*labels, "grpc_code"], registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds",
                                 "Time from the start of an RPC to its end.", labels,
                                 buckets=_SECONDS_BUCKETS, registry=registry)

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        labels = (_kind(handler), *_split(handler_call_details.method))
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, labels), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, labels), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler.stream_unary, labels), handler.request_deserializer,
                handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._streaming(handler.stream_stream, labels), handler.request_deserializer,
            handler.response_serializer)

    def _done(self, labels: tuple[str, str, str], began: float,
              context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
        self.handled.labels(*labels, _code_of(context, error)).inc()
        self.seconds.labels(*labels).observe(time.perf_counter() - began)

    def _unary(self, behavior: Callable[..., Any], labels: tuple[str, str, str]
               ) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.started.labels(*labels).inc()
            began = time.perf_counter()
            try:
                response = behavior(request, context)
                if inspect.isawaitable(response):
                    response = await response
            except BaseException as error:
                self._done(labels, began, context, error)
                raise
            self._done(labels, began, context, None)
            return response
        return wrapped

    def _streaming(self, behavior: Callable[..., Any], labels: tuple[str, str, str]
                   ) -> Callable[..., Any]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            self.started.labels(*labels).inc()
            began = time.perf_counter()
            try:
                responses = behavior(request, context)
                if inspect.isawaitable(responses):  # writes with context.write, returns None
                    await responses
                elif hasattr(responses, "__aiter__"):
                    async for response in responses:
                        yield response
                else:
                    for response in responses:
                        yield response
            except BaseException as error:
                self._done(labels, began, context, error)
                raise
            self._done(labels, began, context, None)
        return wrapped
