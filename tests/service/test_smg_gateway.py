"""The smg gateway (PyPI's `smg`, the router vLLM and SGLang deployments put in
front of gRPC workers) in front of the shared server, speaking vLLM's engine
protocol: OpenAI completions and chat equal our own answers, streaming works,
a client that hangs up gets its request aborted, and smg needs no local model
(it takes the tokenizer and chat template from GetTokenizer)."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esurge import SamplingParams
from service.client import EngineClient
from tests.service.conftest import LiveServer

pytestmark = [pytest.mark.timeout(300)]

SMG = Path(sys.executable).with_name("smg")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(port: int, method: str, path: str, body: Any = None,
          timeout: float = 60) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"content-type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        return reply.status, json.loads(data) if data else None
    finally:
        conn.close()


@pytest.fixture(scope="module")
def gateway(live_server: LiveServer) -> Iterator[int]:
    """smg on a free loopback port, routing to the shared server; no model path."""
    if not SMG.is_file() and shutil.which("smg") is None:
        pytest.fail("the smg gateway is not installed (make install puts it in the venv)")
    port, metrics = _free_port(), _free_port()
    proc = subprocess.Popen(
        [str(SMG), "launch", "--worker-urls", f"grpc://{live_server.target}",
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(metrics), "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:  # up once its worker is registered and has passed a health check
                status, ready = _http(port, "GET", "/readiness", timeout=5)
                if status == 200 and ready["healthy_workers"] >= 1:
                    break
            except (OSError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                pytest.fail(f"smg did not come up: {err[-2000:]}")
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def _model(port: int) -> str:
    return str(_http(port, "GET", "/v1/models")[1]["data"][0]["id"])


def test_completions_equal_our_generate(gateway: int, client: EngineClient) -> None:
    prompt = "def add(a, b):"
    ours = client.generate_unary(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                        ignore_eos=True)).completions[0]
    status, reply = _http(gateway, "POST", "/v1/completions", {
        "model": _model(gateway), "prompt": prompt, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, reply
    assert reply["choices"][0]["text"] == ours.text
    assert reply["usage"]["completion_tokens"] == len(ours.token_ids) == 16


def test_chat_equals_esurge_chat(gateway: int, live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "import os"}]
    ours = live_server.engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))
    status, reply = _http(gateway, "POST", "/v1/chat/completions", {
        "model": _model(gateway), "messages": messages, "max_tokens": 12, "temperature": 0})
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"] == ours.outputs[0].text
    assert reply["choices"][0]["finish_reason"] == ours.outputs[0].finish_reason


def _sse(port: int, body: dict[str, Any], keep: int | None = None) -> list[dict[str, Any]]:
    """The data events of a streamed completion; with keep, hang up after that many."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"content-type": "application/json"})
    reply = conn.getresponse()
    events: list[dict[str, Any]] = []
    try:
        while keep is None or len(events) < keep:
            line = reply.readline()
            if not line:
                break
            text = line.decode().strip()
            if text.startswith("data: ") and text != "data: [DONE]":
                events.append(json.loads(text[6:]))
    finally:
        conn.close()
    return events


def test_streaming_and_a_client_that_hangs_up(gateway: int, live_server: LiveServer) -> None:
    body = {"model": _model(gateway), "prompt": "class Point:", "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    events = _sse(gateway, body)
    streamed = "".join(e["choices"][0]["text"] for e in events)
    status, whole = _http(gateway, "POST", "/v1/completions", body)
    assert status == 200 and streamed == whole["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # A long stream dropped after two events: smg aborts it, the engine frees it.
    _sse(gateway, {**body, "max_tokens": 400}, keep=2)
    load = live_server.wait_idle(timeout=30)
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
    assert load.kv_cache_usage == 0.0


def test_smg_lists_the_worker_healthy(gateway: int, live_server: LiveServer) -> None:
    status, ready = _http(gateway, "GET", "/readiness")
    assert status == 200 and ready["healthy_workers"] == ready["total_workers"] == 1
    _, listing = _http(gateway, "GET", "/workers")
    [worker] = listing["workers"]
    assert worker["url"] == f"grpc://{live_server.target}"
    assert worker["runtime_type"] == "vllm" and worker["connection_mode"] == "grpc"
    assert worker["models"][0]["context_length"] == (
        live_server.engine.config.scheduler_config.max_model_len)


# OpenAI fields smg forwards, one at a time, on a base where each changes the
# output (the test checks that it does, so a field dropped on the way fails).
GREEDY = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": 12, "ignore_eos": True}
FORWARDED = [
    (GREEDY, {"presence_penalty": 2.0}), (GREEDY, {"frequency_penalty": -2.0}),
    (GREEDY, {"repetition_penalty": 1.5}), (GREEDY, {"stop": ["e"]}),
    (SAMPLED, {"top_k": 5}), (SAMPLED, {"top_p": 0.05}), (SAMPLED, {"min_p": 0.99}),
    (SAMPLED, {"seed": 4}), (SAMPLED, {"n": 2, "temperature": 0.8}),
]


def _params(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in body.items()})


@pytest.mark.parametrize(("base", "option"), FORWARDED)
def test_sampling_options_through_smg_act_as_in_the_library(
        gateway: int, live_server: LiveServer, base: dict[str, Any],
        option: dict[str, Any]) -> None:
    prompt = "def add(a, b):"
    [ours] = live_server.engine.generate([prompt], _params({**base, **option}))
    [without] = live_server.engine.generate([prompt], _params(base))
    expected = [(o.text, o.finish_reason) for o in ours.outputs]
    assert expected != [(o.text, o.finish_reason) for o in without.outputs]
    status, reply = _http(gateway, "POST", "/v1/completions",
                          {"model": _model(gateway), "prompt": prompt, **base, **option})
    assert status == 200, reply
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert [(c["text"], c["finish_reason"]) for c in choices] == expected
    assert reply["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in ours.outputs)


def test_chat_logprobs_through_smg_are_the_library_s(gateway: int,
                                                    live_server: LiveServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    ours = live_server.engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=5,
                                                            logprobs=2)).outputs[0]
    status, reply = _http(gateway, "POST", "/v1/chat/completions", {
        "model": _model(gateway), "messages": messages, "max_tokens": 5, "temperature": 0,
        "logprobs": True, "top_logprobs": 2})
    assert status == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert ours.logprobs is not None and len(content) == len(ours.logprobs) == 5
    for entry, lp in zip(content, ours.logprobs, strict=True):
        assert entry["logprob"] == pytest.approx(lp.logprobs[0], abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            list(lp.logprobs[1:3]), abs=1e-4)
