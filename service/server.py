"""The gRPC server: EngineService, vLLM's engine protocol, grpc.health.v1 and
reflection on one port, and Prometheus metrics over HTTP on another when asked.

`create_server(engine, port=0)` gives a serving server in one call (tests,
embedding). `EngineServer` exposes the life cycle the CLI needs: listen
first (health NOT_SERVING while the engine warms up), attach the engine
(SERVING), drain on SIGTERM (NOT_SERVING, refuse new calls, let in-flight
calls finish within a grace period), stop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from generated.esurge.v1 import service_pb2
from service.admission import AdmissionPolicy
from service.grpc_metrics import GrpcServerMetrics
from service.health import Phase, ServingState
from service.info import model_name
from service.metrics import EngineMetrics
from service.servicer import EngineServicer
from service.vllm_servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from service.vllm_servicer import VllmEngineServicer
from service.wire import engine_service_handler

if TYPE_CHECKING:
    from esurge.engine.api import eSurge

__all__ = ["EngineServer", "ServerOptions", "TlsConfig", "create_server"]

log = logging.getLogger(__name__)

ENGINE_SERVICE_NAME: str = service_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
# How often an idle server checks that its engine thread is still alive.
_WATCH_INTERVAL_S = 1.0
# After the drain, what is left (health Watch streams, reflection) gets this long.
_FINAL_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """PEM server certificate chain and key; a client CA turns on mutual TLS."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None

    def __post_init__(self) -> None:
        for name in ("cert_chain", "private_key"):
            if not getattr(self, name):
                raise ValueError(f"{name} must be non-empty PEM bytes")
        if self.client_ca is not None and not self.client_ca:
            raise ValueError("client_ca must be None or non-empty PEM bytes")

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path,
                   client_ca: str | Path | None = None) -> TlsConfig:
        """Read the PEM files."""
        return cls(Path(cert).read_bytes(), Path(key).read_bytes(),
                   Path(client_ca).read_bytes() if client_ca is not None else None)

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials; with a client CA, clients must present a certificate."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """Transport and admission limits of a server."""

    max_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_streams: int | None = None
    max_queued_requests: int = 1024
    tls: TlsConfig | None = None
    # Prometheus metrics over HTTP on this port (None: off; 0: a free one).
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Also serve vLLM's engine protocol (vllm.grpc.engine.VllmEngine) for
    # gateways such as smg, on the same port and engine.
    vllm_protocol: bool = True

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {self.max_message_bytes}")
        if self.max_concurrent_streams is not None and self.max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams must be None or >= 1, "
                             f"got {self.max_concurrent_streams}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, "
                             f"got {self.max_queued_requests}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be None or in [0, 65535], "
                             f"got {self.metrics_port}")

    def channel_options(self) -> list[tuple[str, int]]:
        """The grpc core options these limits translate to."""
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # A second server on a busy port must fail, not silently share it.
            ("grpc.so_reuseport", 0),
        ]
        if self.max_concurrent_streams is not None:
            options.append(("grpc.max_concurrent_streams", self.max_concurrent_streams))
        return options


class EngineServer:
    """A grpc.aio server around one engine, with health, reflection and drain.

    Build it inside the event loop that will run it. The port is bound at
    construction (`port=0` picks a free one, see `.port`).
    """

    def __init__(self, options: ServerOptions | None = None, *, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.options = options or ServerOptions()
        self.state = ServingState()
        self.servicer = EngineServicer(
            self.state, AdmissionPolicy(max_queued_requests=self.options.max_queued_requests))
        self.registry = CollectorRegistry()
        self.server = grpc.aio.server(options=self.options.channel_options(),
                                      interceptors=(GrpcServerMetrics(self.registry),))
        self.server.add_generic_rpc_handlers((engine_service_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.state.health, self.server)
        services = [ENGINE_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
        if self.options.vllm_protocol:
            vllm_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(self.servicer),
                                                       self.server)
            services.append(VLLM_SERVICE_NAME)
        reflection.enable_server_reflection(services, self.server)
        address = f"{host}:{port}"
        tls = self.options.tls
        try:
            self.port = (self.server.add_secure_port(address, tls.credentials()) if tls
                         else self.server.add_insecure_port(address))
        except RuntimeError as err:
            raise OSError(f"cannot listen on {address}: {err}") from err
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self._watch: asyncio.TimerHandle | None = None
        self._metrics_http: Any = None
        self.metrics_port: int | None = None

    async def start(self) -> None:
        """Listen; health is NOT_SERVING and calls are refused until `attach`."""
        await self.state.initialize()
        await self.server.start()
        self._start_metrics()
        self._schedule_watch()

    def _start_metrics(self) -> None:
        port = self.options.metrics_port
        if port is None:
            return
        self._metrics_http, _ = start_http_server(port, addr=self.options.metrics_host,
                                                  registry=self.registry)
        self.metrics_port = int(self._metrics_http.server_port)
        log.info("metrics on http://%s:%d/metrics", self.options.metrics_host,
                 self.metrics_port)

    async def attach(self, engine: eSurge) -> None:
        """Serve `engine` (warmed up) and report SERVING."""
        self.servicer.attach(engine)
        EngineMetrics(engine, model_name(engine), self.registry)
        failure = self.servicer.engine_failure()
        if failure is not None:
            await self.state.mark_failed(failure)
        await self.state.set_serving()

    def _schedule_watch(self) -> None:
        # A timer rather than a task: the loop holds it, and it notices an
        # engine that dies while no call is running.
        self._watch = asyncio.get_running_loop().call_later(_WATCH_INTERVAL_S, self._watch_engine)

    def _watch_engine(self) -> None:
        self.servicer.check_engine()
        if self.state.phase in (Phase.STARTING, Phase.SERVING):
            self._schedule_watch()

    async def drain(self, grace_s: float) -> bool:
        """NOT_SERVING, refuse new calls, and wait up to `grace_s` for in-flight ones.

        Requests still running after the grace period are aborted. Returns
        True when every call finished in time. Stops the server.
        """
        await self.state.begin_drain()
        log.info("draining: %d call(s) in flight, grace period %.1fs",
                 self.state.in_flight, grace_s)
        finished = await self.state.wait_idle(grace_s)
        bridge = self.servicer.bridge
        if not finished and bridge is not None:
            aborted = bridge.abort_all()
            log.warning("grace period over: aborted %d request(s)", len(aborted))
        await self.stop()
        return finished

    async def stop(self) -> None:
        """Stop serving now (remaining calls get a short grace)."""
        if self._watch is not None:
            self._watch.cancel()
        await self.server.stop(_FINAL_GRACE_S)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
            self._metrics_http = None


async def create_server(engine: eSurge, options: ServerOptions | None = None, *,
                        host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Start a server for an already warmed-up engine; returns it and its port.

    Call inside a running event loop; stop it with `await server.stop(grace)`.
    The engine keeps running afterwards (call `engine.shutdown()` yourself).
    """
    engine_server = EngineServer(options, host=host, port=port)
    await engine_server.start()
    await engine_server.attach(engine)
    return engine_server.server, engine_server.port
