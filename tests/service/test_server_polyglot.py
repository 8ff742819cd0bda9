"""Other clients and a proxy in front: Node.js (@grpc/grpc-js), `buf curl` through
reflection alone, and nginx `grpc_pass` as a sidecar would sit.

These need tools from outside Python: npm (registry access) and nginx (Debian
package `nginx-light`). Missing tools fail the tests; they are not skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2
from service.client import EngineClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
BUF = Path(sys.executable).parent / "buf"
# npm packages go to a git-ignored folder, so reruns reuse them.
NODE_DIR = REPO / "build" / "node-grpc-client"
PROMPT = [17, 99, 250, 3, 41, 8]
MAX_TOKENS = 20


def expected_tokens(live_server: Any) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [output] = live_server.engine.generate([PROMPT], params)
    tokens: list[int] = output.outputs[0].token_ids
    return tokens


# Debian puts nginx in /usr/sbin, which a normal user's PATH often lacks.
_TOOL_PATH = os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"])


def _tool(name: str) -> str:
    path = shutil.which(name, path=_TOOL_PATH)
    assert path is not None, (f"{name} is not installed; the polyglot tests need it "
                              f"(`make sysdeps` installs it)")
    return path


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """@grpc/grpc-js and @grpc/proto-loader, installed from the npm registry."""
    _tool("node")
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [_tool("npm"), "install", "--prefix", str(NODE_DIR), "--no-audit", "--no-fund",
         "--loglevel", "error", "@grpc/grpc-js@1", "@grpc/proto-loader@0"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"npm install failed:\n{done.stdout}\n{done.stderr}"
    return NODE_DIR / "node_modules"


def test_node_client_streams_the_same_tokens(live_server: Any, client: EngineClient,
                                             node_modules: Path) -> None:
    script = Path(__file__).parent / "polyglot" / "generate.js"
    done = subprocess.run(
        [_tool("node"), str(script), live_server.target, str(REPO / "protos"), "node-1",
         str(MAX_TOKENS), *map(str, PROMPT)],
        env={**os.environ, "NODE_PATH": str(node_modules)},
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["tokens"] == expected_tokens(live_server)
    assert result["finish"] == "FINISH_REASON_LENGTH"
    assert result["requestId"] == "node-1"
    assert result["messages"] >= 2  # streamed, not one lump


def _json_stream(text: str) -> list[dict[str, Any]]:
    decoder, at, items = json.JSONDecoder(), 0, []
    while at < len(text.rstrip()):
        while text[at].isspace():
            at += 1
        item, at = decoder.raw_decode(text, at)
        items.append(item)
    return items


def _buf_curl(*args: str) -> subprocess.CompletedProcess[str]:
    assert BUF.is_file(), f"buf CLI missing at {BUF}: install the dev extras (buf-bin)"
    return subprocess.run([str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
                           *args], capture_output=True, text=True, timeout=120, check=False)


def test_buf_curl_generates_through_reflection_alone(live_server: Any,
                                                     client: EngineClient) -> None:
    base = f"http://{live_server.target}"
    services = _buf_curl("--list-services", base)
    assert services.returncode == 0, services.stderr
    assert "esurge.v1.EngineService" in services.stdout.split()
    body = json.dumps({"request": {
        "promptTokenIds": {"tokenIds": PROMPT},
        "samplingParams": {"temperature": 0, "maxTokens": MAX_TOKENS, "ignoreEos": True}}})
    done = _buf_curl("-d", body, f"{base}/esurge.v1.EngineService/Generate")
    assert done.returncode == 0, done.stderr
    messages = _json_stream(done.stdout)
    assert [t for m in messages for t in m.get("tokenIds", [])] == expected_tokens(live_server)
    assert messages[-1]["finishReason"] == "FINISH_REASON_LENGTH"
    assert "promptInfo" in messages[0]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


NGINX_CONF = """daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
worker_processes 1;
events {{ worker_connections 256; }}
http {{
  access_log {dir}/access.log;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  fastcgi_temp_path {dir}/fastcgi;
  uwsgi_temp_path {dir}/uwsgi;
  scgi_temp_path {dir}/scgi;
  server {{
    listen 127.0.0.1:{port} http2;
    location / {{
      grpc_pass grpc://{upstream};
      grpc_read_timeout 120s;
    }}
  }}
}}
"""


@pytest.fixture
def nginx(live_server: Any, tmp_path: Path) -> Iterator[str]:
    """nginx on a free loopback port, proxying gRPC to the live server."""
    port = _free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=tmp_path, port=port, upstream=live_server.target))
    proc = subprocess.Popen([_tool("nginx"), "-c", str(conf), "-p", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"nginx exited: {proc.stderr.read() if proc.stderr else ''}"
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "nginx did not start listening"
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def test_streaming_through_nginx(live_server: Any, client: EngineClient, nginx: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with EngineClient(nginx, timeout=60) as proxied:
        assert proxied.health() == "SERVING"
        stream = proxied.generate(PROMPT, params, metadata=[("x-request-id", "via-nginx")])
        messages = list(stream)
        assert dict(stream.initial_metadata())["x-request-id"] == "via-nginx"
    assert [t for m in messages for t in m.token_ids] == expected_tokens(live_server)
    assert len(messages) >= 2
    assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
