"""Tokenizer, descriptions, load, health, reflection, the client CLI, and mutual TLS."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from esurge.sampling_params import SamplingParams
from service.client import EngineClient, channel_credentials
from service.errors import field_violations, status_from_rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_tokenize_and_detokenize_use_the_model_tokenizer(live_server: Any,
                                                         client: EngineClient) -> None:
    tokenizer = live_server.engine.tokenizer
    text = "def add(a, b):\n    return a + b\n"
    ids = client.tokenize(text)
    assert ids == tokenizer.encode(text).ids
    assert client.detokenize(ids) == text
    assert client.detokenize([1, *ids, 2], skip_special_tokens=False) == "<s>" + text + "</s>"
    assert client.detokenize([1, *ids, 2]) == text
    with pytest.raises(grpc.RpcError) as info:
        client.detokenize([5, 512])
    status = status_from_rpc_error(info.value)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status is not None
    assert [v.field for v in field_violations(status)] == ["token_ids[1]"]


def test_model_and_server_info(live_server: Any, client: EngineClient) -> None:
    model = client.model_info()
    assert (model.architecture, model.model_type, model.vocab_size) == (
        "LlamaForCausalLM", "llama", 512)
    assert model.max_model_len == 512
    assert (model.special_token_ids.bos_token_id, list(model.special_token_ids.eos_token_ids),
            model.special_token_ids.pad_token_id) == (1, [2], 0)
    assert model.supported_options.has_tokenizer
    assert {"temperature", "top_p", "logit_bias", "seed"} <= set(
        model.supported_options.sampling_params)
    assert model.dtype == "float32"
    server = client.server_info()
    assert server.api_version == "esurge.v1"
    assert {"jax", "grpcio", "protobuf"} <= set(server.library_versions)
    assert (server.page_size, server.num_pages, server.num_speculative_tokens) == (8, 128, 0)
    sched = server.config.scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len) == (
        8, 64, 512)
    assert server.config.cache_config.enable_prefix_caching
    assert not server.config.HasField("speculative_config")
    assert server.platform == "cpu"


def test_load_of_an_idle_server(client: EngineClient) -> None:
    load = client.load()
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
    assert load.kv_cache_usage == 0.0
    assert load.num_free_pages == 127  # every page but the null page
    assert not load.draining


def test_health_of_both_service_names(live_server: Any) -> None:
    with grpc.insecure_channel(live_server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "esurge.v1.EngineService"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_services(live_server: Any) -> None:
    with grpc.insecure_channel(live_server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        asks = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="esurge.v1.EngineService"),
                reflection_pb2.ServerReflectionRequest(
                    file_containing_symbol="vllm.grpc.engine.VllmEngine")]
        listed, described, vllm = list(stub.ServerReflectionInfo(iter(asks), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert names == {"esurge.v1.EngineService", "grpc.health.v1.Health",
                     "grpc.reflection.v1alpha.ServerReflection", "vllm.grpc.engine.VllmEngine"}
    files = described.file_descriptor_response.file_descriptor_proto
    assert len(files) >= 1  # esurge/v1/service.proto and the files it imports
    assert len(vllm.file_descriptor_response.file_descriptor_proto) >= 1


def _client_cli(live_server: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.client_cli", "--target", live_server.target,
         "--timeout", "60", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
        check=False)


def test_client_cli(live_server: Any, client: EngineClient) -> None:
    prompt = "class Stack:\n"
    [expected] = live_server.engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    done = _client_cli(live_server, "generate", prompt, "--max-tokens", "12", "--ignore-eos")
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected.outputs[0].text + "\n"
    assert "[12 tokens, FINISH_REASON_LENGTH]" in done.stderr
    ids = _client_cli(live_server, "generate", prompt, "--max-tokens", "12", "--ignore-eos",
                      "--show-ids")
    assert ids.stdout.split() == [str(t) for t in expected.outputs[0].token_ids]
    tokens = _client_cli(live_server, "tokenize", "import os")
    assert tokens.stdout.split() == [str(t) for t in client.tokenize("import os")]
    info = _client_cli(live_server, "info")
    assert json.loads(info.stdout)["model"]["vocab_size"] == 512
    health = _client_cli(live_server, "health")
    assert (health.returncode, health.stdout) == (0, "SERVING\n")
    bad = _client_cli(live_server, "generate", "--token-ids", "5 999")
    assert bad.returncode == 1
    assert bad.stderr.startswith("esurge-client: INVALID_ARGUMENT: ")
    assert "  request.prompt_token_ids: " in bad.stderr
    local = _client_cli(live_server, "generate", "x", "--top-p", "2")
    assert (local.returncode, local.stderr) == (
        2, "esurge-client: top_p must be in (0, 1], got 2.0\n")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certs(out: Path) -> None:
    """A test CA, a server certificate for 127.0.0.1, and a client certificate."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=esurge-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign", cwd=out)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (out / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=esurge-test-{name}", cwd=out)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", f"{name}.ext", cwd=out)


def test_mutual_tls(live_server: Any, tmp_path: Path) -> None:
    from service.server import EngineServer, ServerOptions, TlsConfig

    _make_certs(tmp_path)
    tls = TlsConfig.from_files(tmp_path / "server.pem", tmp_path / "server.key",
                               client_ca=tmp_path / "ca.pem")

    async def start() -> EngineServer:
        server = EngineServer(ServerOptions(tls=tls))
        await server.start()
        await server.attach(live_server.engine)
        return server

    server = live_server.run(start())
    target = f"127.0.0.1:{server.port}"
    try:
        with EngineClient(target, timeout=30, credentials=channel_credentials(
                tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "client.key")) as c:
            response = c.generate_unary([5, 6, 7], SamplingParams(max_tokens=3))
            assert len(response.completions[0].token_ids) <= 3
            assert c.health() == "SERVING"
        # Without a client certificate the handshake is refused.
        with EngineClient(target, timeout=10, credentials=channel_credentials(
                tmp_path / "ca.pem")) as c, pytest.raises(grpc.RpcError) as info:
            c.health()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        live_server.run(server.stop())


def test_max_message_size_is_enforced(live_server: Any) -> None:
    from service.server import EngineServer, ServerOptions

    async def start() -> EngineServer:
        server = EngineServer(ServerOptions(max_message_bytes=1024))
        await server.start()
        await server.attach(live_server.engine)
        return server

    server = live_server.run(start())
    try:
        with EngineClient(f"127.0.0.1:{server.port}", timeout=30) as c:
            assert c.tokenize("x" * 500) == live_server.engine.tokenizer.encode("x" * 500).ids
            with pytest.raises(grpc.RpcError) as info:
                c.tokenize("x" * 2000)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        live_server.run(server.stop())
