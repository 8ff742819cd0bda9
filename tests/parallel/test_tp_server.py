"""`esurge-serve --tensor-parallel-size 2`: the real server process on a 2-device mesh."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from esurge import ParallelConfig, SamplingParams, eSurge
from service.client import EngineClient
from tests.service.test_server_cli import ServeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROMPT = [5, 9, 22, 7, 3, 14, 60, 2, 8]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# The tiny checkpoints allow 128 positions.
SMALL_ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len",
                "128", "--enable-chunked-prefill", "--num-pages", "64", "--page-size", "8"]


def test_serves_on_a_two_device_mesh(checkpoint: Callable[..., Path]) -> None:
    path = checkpoint("llama")
    with eSurge(path, warmup=False, show_progress=False,
                parallel_config=ParallelConfig(1)) as llm:
        want = llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids
    process = ServeProcess(path, *SMALL_ENGINE, "--tensor-parallel-size", "2")
    try:
        port = int(process.wait_for_log(r"listening on 127\.0\.0\.1:(\d+)").group(1))
        with EngineClient(f"127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 300
            while client.health() != "SERVING":
                assert time.monotonic() < deadline, process.log
                time.sleep(0.1)
            info = client.server_info()
            assert (info.num_devices, dict(info.mesh_axes)) == (2, {"tp": 2})
            out = client.generate_unary(PROMPT, PARAMS)
        assert list(out.completions[0].token_ids) == want
    finally:
        process.stop()


def test_a_degree_the_heads_refuse_names_the_flag(checkpoint: Callable[..., Path]) -> None:
    process = ServeProcess(checkpoint("llama"), *SMALL_ENGINE, "--tensor-parallel-size", "3")
    try:
        process.wait_for_log(r"tensor_parallel_size=3 does not divide the model: 4 attention "
                             r"heads")
        assert process.proc.wait(60) != 0
    finally:
        process.stop()
