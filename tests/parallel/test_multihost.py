"""Two processes x two CPU devices, one JAX job: served from host 0 over gRPC."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from esurge import ParallelConfig, SamplingParams, eSurge
from esurge.structured_output.params import StructuredOutputsParams
from service.client import EngineClient
from service.errors import field_violations, status_from_rpc_error
from tests.parallel.conftest import engine_config
from tests.service.test_server_cli import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [5, 9, 22, 7, 3, 14, 60, 2, 8]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Async scheduling as `make serve` runs: the leader dispatches step N + 1 before
# it collects step N, and the followers mirror that order.
ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128",
          "--enable-chunked-prefill", "--num-pages", "64", "--page-size", "8",
          "--async-scheduling"]
# Each process sees two CPU devices, as two hosts with two accelerators would.
TWO_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def _free_port_pair() -> int:
    """A port p with p + 1 free too (the coordinator and the step channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return int(port)
    raise RuntimeError("no free port pair")


def _hosts(model: Path, *leader_flags: str, follower_flags: tuple[str, ...] = ()
           ) -> tuple[ServeProcess, ServeProcess]:
    port = _free_port_pair()
    job = ["--tensor-parallel-size", "4", "--num-hosts", "2",
           "--coordinator-address", f"127.0.0.1:{port}"]
    leader = ServeProcess(model, *ENGINE, *job, "--host-rank", "0", *leader_flags,
                          env=TWO_DEVICES)
    follower = ServeProcess(model, *ENGINE, *job, "--host-rank", "1", *follower_flags,
                            env=TWO_DEVICES)
    return leader, follower


@pytest.fixture
def job(checkpoint: Callable[..., Path]) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    leader, follower = _hosts(checkpoint("llama"))
    yield leader, follower
    follower.stop()
    leader.stop()


def _wait_serving(client: EngineClient, leader: ServeProcess, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while client.health() != "SERVING":
        assert time.monotonic() < deadline and leader.proc.poll() is None, leader.log
        time.sleep(0.2)


def test_two_hosts_serve_the_one_process_tokens_and_fail_fast_when_one_dies(
        job: tuple[ServeProcess, ServeProcess], checkpoint: Callable[..., Path]) -> None:
    with eSurge(checkpoint("llama"), engine_config(), warmup=False, show_progress=False,
                parallel_config=ParallelConfig(4)) as llm:
        want = llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    leader, follower = job
    port = int(leader.wait_for_log(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    with EngineClient(f"127.0.0.1:{port}", timeout=60) as client:
        _wait_serving(client, leader)
        info = client.server_info()
        assert (info.num_devices, dict(info.mesh_axes)) == (4, {"tp": 4})
        out = client.generate_unary(PROMPT, PARAMS)
        assert list(out.completions[0].token_ids) == want
        constrained = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no"]))
        with pytest.raises(grpc.RpcError) as refused:
            client.generate_unary(PROMPT, constrained)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = status_from_rpc_error(refused.value)
        assert status is not None
        assert [v.field for v in field_violations(status)] == [
            "request.sampling_params.structured_outputs"]

        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        stream = client.generate(PROMPT, long, request_id="in-flight")
        next(stream)
        follower.proc.kill()
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as ended:
            for _ in stream:
                pass
        assert ended.value.code() == grpc.StatusCode.INTERNAL, leader.log[-5000:]
        while client.health() != "NOT_SERVING":
            assert time.monotonic() - killed < 10, leader.log
            time.sleep(0.1)
    assert time.monotonic() - killed < 10
    assert "host 1 left the job" in leader.log


def test_a_follower_with_another_config_is_refused_at_the_handshake(
        checkpoint: Callable[..., Path]) -> None:
    leader, follower = _hosts(checkpoint("llama"), follower_flags=("--max-num-seqs", "3"))
    try:
        leader.wait_for_log(r"host 1 does not match the leader")
        leader.wait_for_log(r"config\.scheduler_config\.max_num_seqs: 2 vs 3")
        follower.wait_for_log(r"config\.scheduler_config\.max_num_seqs: 2 vs 3")
    finally:
        follower.stop()
        leader.stop()


def test_a_follower_exits_when_its_leader_dies(job: tuple[ServeProcess, ServeProcess]) -> None:
    leader, follower = job
    port = int(leader.wait_for_log(r"listening on 127\.0\.0\.1:(\d+)").group(1))
    with EngineClient(f"127.0.0.1:{port}", timeout=60) as client:
        _wait_serving(client, leader)
    follower.wait_for_log(r"host 1 follows the leader's steps")
    leader.proc.kill()
    assert follower.proc.wait(15) == 1, follower.log
    assert "the other host closed the step channel" in follower.log
