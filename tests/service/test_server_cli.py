"""The real `python -m service` process: health through warm-up, SIGTERM drain, bad flags."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2, service_pb2
from service.client import EngineClient, build_request
from service.errors import retry_delay_s, status_from_rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
# The smallest engine that serves: one token bucket, one request bucket.
SMALL_ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len",
                "256", "--enable-chunked-prefill", "--num-pages", "64", "--page-size", "8"]


class ServeProcess:
    """`python -m service` on a free port, its log collected as it comes."""

    def __init__(self, model: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--model", str(model), "--port", "0", *flags],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_for_log(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the server log:\n{self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def serve_process(tiny_llama_dir: Path) -> Iterator[ServeProcess]:
    # Decode bursts on: the greedy streams below then come in bursts of 4 tokens.
    process = ServeProcess(tiny_llama_dir, *SMALL_ENGINE, "--grace-period", "60",
                           "--decode-steps", "4")
    yield process
    process.stop()


def _wait_health(client: EngineClient, wanted: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while client.health() != wanted:
        assert time.monotonic() < deadline, f"health never became {wanted}"
        time.sleep(0.1)


def test_warm_up_serve_and_drain_on_sigterm(serve_process: ServeProcess) -> None:
    port = int(serve_process.wait_for_log(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    with EngineClient(f"127.0.0.1:{port}", timeout=30) as client:
        # Listening before the engine is ready: NOT_SERVING, calls refused for now.
        assert client.health() == "NOT_SERVING"
        assert client.health("esurge.v1.EngineService") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as early:
            client.generate_unary([1, 2, 3])
        assert early.value.code() == grpc.StatusCode.UNAVAILABLE
        status = status_from_rpc_error(early.value)
        assert status is not None and retry_delay_s(status) == 5.0

        _wait_health(client, "SERVING", timeout=300)
        assert client.health("esurge.v1.EngineService") == "SERVING"
        params = SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True)
        stream = client.generate([5, 6, 7], params, request_id="in-flight")
        first = next(stream)
        feed: queue.SimpleQueue[service_pb2.EngineStreamRequest | None] = queue.SimpleQueue()
        router = client.engine_stream(iter(feed.get, None))
        feed.put(service_pb2.EngineStreamRequest(
            add_request=build_request([8, 9], params, request_id="routed")))
        routed = list(next(router).outputs.outputs)

        serve_process.proc.send_signal(signal.SIGTERM)
        _wait_health(client, "NOT_SERVING", timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            client.generate_unary([1, 2, 3])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert client.load().draining
        feed.put(service_pb2.EngineStreamRequest(
            add_request=build_request([8, 9], params, request_id="too-late")))

        rest = list(stream)  # the stream in flight runs to its end
        assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 240
        serve_process.wait_for_log(r"decode bursts: up to 4 decode iterations")
        # The router's stream ends by itself once its request is done, though the
        # router has not closed it; its new request was refused as UNAVAILABLE.
        responses = list(router)
        feed.put(None)
        routed += [o for r in responses for o in r.outputs.outputs]
        assert sum(len(o.new_token_ids) for o in routed) == 240
        assert routed[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert [(r.rejection.request_id, r.rejection.code) for r in responses
                if r.HasField("rejection")] == [("too-late", 14)]
    assert serve_process.proc.wait(60) == 0, serve_process.log
    assert "draining: 2 call(s) in flight" in serve_process.log
    assert "stopped (drained)" in serve_process.log


@pytest.mark.parametrize("model", ["models/no-such-model", "/no/such/checkpoint"])
def test_a_missing_model_directory_is_named(model: str) -> None:
    done = subprocess.run([sys.executable, "-m", "service", "--model", model], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert (f"argument --model: '{model}' is neither a checkpoint directory, a .gguf file "
            "nor a packaged model name") in done.stderr


def test_a_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "service", "--model", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert f"argument --model: '{tmp_path}' has no config.json" in done.stderr
