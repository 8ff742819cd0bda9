"""Prometheus metrics: after a known workload the counters equal what was sent,
histogram counts equal the requests, gauges agree with GetLoad, and the gRPC
server metrics count calls by method and status code. Scraped over HTTP and
read with prometheus_client's own text parser."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from esurge import SamplingParams
from service.client import EngineClient, build_request
from service.info import model_name
from service.server import EngineServer, ServerOptions
from tests.service.conftest import LiveServer

pytestmark = [pytest.mark.timeout(300)]

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
NEW_TOKENS = 6

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def metered(live_server: LiveServer) -> Iterator[EngineServer]:
    """A second server on the shared engine, with metrics on a free port."""
    async def start() -> EngineServer:
        server = EngineServer(ServerOptions(metrics_port=0))
        await server.start()
        await server.attach(live_server.engine)
        return server

    server = live_server.run(start())
    yield server
    live_server.run(server.stop())


def _scrape(server: EngineServer) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                timeout=10) as reply:
        text = reply.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _scrape_until(server: EngineServer, done: Callable[[Samples], bool],
                  timeout_s: float = 10.0) -> Samples:
    """Scrape until `done` holds of the samples or the time is up (the last scrape)."""
    deadline = time.monotonic() + timeout_s
    samples = _scrape(server)
    while not done(samples) and time.monotonic() < deadline:
        time.sleep(0.01)
        samples = _scrape(server)
    return samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items()
               if n == name and set(labels.items()) <= set(ls))


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def test_counters_and_histograms_match_a_known_workload(
        live_server: LiveServer, metered: EngineServer) -> None:
    before = _scrape(metered)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with EngineClient(f"127.0.0.1:{metered.port}", timeout=60) as client:
        for prompt in PROMPTS:
            client.generate_unary(prompt, params)
    live_server.wait_idle()
    after = _scrape(metered)
    n, tokens = len(PROMPTS), len(PROMPTS) * NEW_TOKENS
    assert _delta(before, after, "vllm:request_success_total", finished_reason="length") == n
    assert _delta(before, after, "vllm:generation_tokens_total") == tokens
    assert _delta(before, after, "vllm:prompt_tokens_total") == sum(map(len, PROMPTS))
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):
        assert _delta(before, after, f"{name}_count") == n, name
    assert _delta(before, after, "vllm:inter_token_latency_seconds_count") == tokens - n
    assert _delta(before, after, "vllm:request_generation_tokens_sum") == tokens
    assert _delta(before, after, "vllm:request_prompt_tokens_sum") == sum(map(len, PROMPTS))
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:num_requests_waiting") == 0
    load = live_server.wait_idle()
    assert _value(after, "vllm:kv_cache_usage_perc") == pytest.approx(load.kv_cache_usage)
    labels = {dict(ls).get("model_name") for n, ls in after if n.startswith("vllm:")}
    assert labels == {model_name(live_server.engine)}


def test_an_aborted_stream_counts_as_abort(live_server: LiveServer,
                                           metered: EngineServer) -> None:
    before = _scrape(metered)
    with EngineClient(f"127.0.0.1:{metered.port}", timeout=60) as client:
        stream = client.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        next(iter(stream))
        stream.cancel()
    live_server.wait_idle()
    after = _scrape(metered)
    assert _delta(before, after, "vllm:request_success_total", finished_reason="abort") == 1
    assert _delta(before, after, "vllm:e2e_request_latency_seconds_count") == 1


def test_grpc_calls_are_counted_by_method_and_code(metered: EngineServer) -> None:
    before = _scrape(metered)
    with EngineClient(f"127.0.0.1:{metered.port}", timeout=60) as client:
        client.model_info()
        client.model_info()
        with pytest.raises(grpc.RpcError):
            client.generate_unary(_bad_request())
    unary = {"grpc_method": "GenerateUnary", "grpc_type": "unary"}
    # context.abort sends the status before the handler's metrics wrapper
    # records the call, so the client can see the error first: wait for the
    # count (bounded), then check every number.
    after = _scrape_until(metered, lambda s: _delta(
        before, s, "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **unary) >= 1)
    method = {"grpc_service": "esurge.v1.EngineService", "grpc_method": "GetModelInfo"}
    assert _delta(before, after, "grpc_server_started_total", **method) == 2
    assert _delta(before, after, "grpc_server_handled_total", grpc_code="OK", **method) == 2
    assert _delta(before, after, "grpc_server_handling_seconds_count", **method) == 2
    assert _delta(before, after, "grpc_server_handled_total", grpc_code="INVALID_ARGUMENT",
                  **unary) == 1


def _bad_request() -> Any:
    msg = build_request([5, 6])
    msg.sampling_params.top_p = 1.5
    return msg
