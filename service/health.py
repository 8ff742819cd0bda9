"""The server's serving phase: gRPC health statuses, refusals, and drain.

A server starts in STARTING (the engine warms up: health NOT_SERVING, calls
refused with UNAVAILABLE), becomes SERVING once the engine is attached, and
leaves SERVING for DRAINING (SIGTERM: NOT_SERVING, new calls UNAVAILABLE,
in-flight calls run on) or FAILED (the engine died: NOT_SERVING, calls
INTERNAL). DRAINING and FAILED are final.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterator

from google.rpc import status_pb2
from grpc_health.v1 import health, health_pb2

from generated.esurge.v1 import service_pb2
from service.errors import internal, unavailable

__all__ = ["HEALTH_SERVICE_NAMES", "Phase", "ServingState"]

# The overall server ("") and the engine service, as probes ask for them.
HEALTH_SERVICE_NAMES: tuple[str, ...] = (
    "", service_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name)

# How long a client should wait before retrying a server that is warming up.
_WARMUP_RETRY_S = 5.0

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Phase(enum.Enum):
    """Where the server is in its life."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FAILED = "failed"


class ServingState:
    """Health statuses and admission of calls, shared by the servicer and the server.

    Create it inside the event loop that runs the server.
    """

    def __init__(self) -> None:
        self.health = health.aio.HealthServicer()
        self.phase = Phase.STARTING
        self.failure: str | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_listeners: set[Callable[[], None]] = set()

    async def initialize(self) -> None:
        """Publish NOT_SERVING for every name (the library starts "" as SERVING)."""
        for name in HEALTH_SERVICE_NAMES:
            await self.health.set(name, _NOT_SERVING)

    async def set_serving(self) -> None:
        """STARTING -> SERVING; ignored once draining or failed."""
        if self.phase is not Phase.STARTING:
            return
        self.phase = Phase.SERVING
        for name in HEALTH_SERVICE_NAMES:
            await self.health.set(name, _SERVING)

    async def begin_drain(self) -> None:
        """Stop admitting calls and report NOT_SERVING, for good; tell the listeners."""
        if self.phase is not Phase.FAILED:
            self.phase = Phase.DRAINING
        await self.health.enter_graceful_shutdown()
        for listener in list(self._drain_listeners):
            listener()

    @contextlib.contextmanager
    def on_drain(self, listener: Callable[[], None]) -> Iterator[None]:
        """Call `listener` if the drain begins while the block runs (long-lived
        streams use it to end once their own requests are done)."""
        self._drain_listeners.add(listener)
        try:
            yield
        finally:
            self._drain_listeners.discard(listener)

    async def mark_failed(self, reason: str) -> None:
        """The engine is dead: NOT_SERVING, and calls get INTERNAL."""
        if self.phase is Phase.FAILED:
            return
        self.phase = Phase.FAILED
        self.failure = reason
        for name in HEALTH_SERVICE_NAMES:
            await self.health.set(name, _NOT_SERVING)

    def refusal(self) -> status_pb2.Status | None:
        """The status to refuse a new engine call with, or None to admit it."""
        if self.phase is Phase.SERVING:
            return None
        if self.phase is Phase.STARTING:
            return unavailable("the server is warming up its engine", _WARMUP_RETRY_S,
                               reason="WARMING_UP")
        if self.phase is Phase.DRAINING:
            return unavailable("the server is draining for shutdown", reason="DRAINING")
        return internal(f"the engine has failed: {self.failure}")

    @contextlib.contextmanager
    def track_call(self) -> Iterator[None]:
        """Count an admitted call as in flight until the block ends (drain waits for it)."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @property
    def in_flight(self) -> int:
        """Admitted calls not finished yet."""
        return self._in_flight

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
