"""One real server for the service tests: the tiny Llama engine behind create_server.

The server runs on its own event loop in a background thread, as it would in
its own process, so tests can use the blocking client or the asyncio client
on their own loops. The engine is shared (warm-up compiles XLA programs once
per session); tests must leave it idle (every request finished or aborted).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from esurge.config import CacheConfig, Config, SchedulerConfig

T = TypeVar("T")

# Small enough to warm up quickly, large enough for concurrency: 8 running
# sequences, 64-token steps, 1016 tokens of KV, requests up to 512 tokens.
SERVER_CONFIG = Config(
    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                    chunked_prefill_enabled=True),
    CacheConfig(num_pages=128, page_size=8, enable_prefix_caching=True),
)
MAX_QUEUED_REQUESTS = 40


@dataclass
class LiveServer:
    """A started server around the shared engine."""

    engine: Any  # esurge.engine.api.eSurge
    port: int
    loop: asyncio.AbstractEventLoop
    server: Any  # grpc.aio.Server
    max_queued_requests: int = MAX_QUEUED_REQUESTS

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """Poll GetLoad's numbers (read in-process) until nothing runs or waits."""
        from service.info import load_info

        deadline = time.monotonic() + timeout
        while True:
            load = load_info(self.engine.stats, draining=False)
            idle = (load.num_running_requests == 0 and load.num_waiting_requests == 0
                    and load.kv_cache_usage == 0.0)
            if idle or time.monotonic() > deadline:
                return load
            time.sleep(0.01)


def _start_loop() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-grpc-server", daemon=True)
    thread.start()
    return loop, thread


@pytest.fixture(scope="session")
def live_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    """The shared engine served on a loopback port."""
    from esurge.engine.api import eSurge
    from service.server import ServerOptions, create_server

    engine = eSurge(tiny_llama_dir, SERVER_CONFIG, show_progress=False)
    loop, thread = _start_loop()
    options = ServerOptions(max_queued_requests=MAX_QUEUED_REQUESTS)
    server, port = asyncio.run_coroutine_threadsafe(
        create_server(engine, options), loop).result(30)
    live = LiveServer(engine, port, loop, server)
    try:
        yield live
    finally:
        live.run(server.stop(None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        engine.shutdown()


@pytest.fixture
def client(live_server: LiveServer) -> Iterator[Any]:
    """A blocking client of the shared server; the engine is idle again afterwards."""
    from service.client import EngineClient

    with EngineClient(live_server.target, timeout=60) as c:
        yield c
    load = live_server.wait_idle()
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0), load
