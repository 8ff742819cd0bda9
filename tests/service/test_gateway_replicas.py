"""Two replica processes behind smg and behind Envoy: round robin spreads the
load; cache-aware routing keeps shared prefixes on one replica (a higher
prefix-cache hit rate, from the replicas' own metrics, than round robin in
the same run); Envoy's least-request balancing uses both; SIGTERM to one
replica under load loses nothing and smg stops sending to it."""

from __future__ import annotations

import http.client
import json
import random
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from esurge import SamplingParams
from tests.service.test_server_cli import ServeProcess
from tests.service.test_smg_gateway import SMG, _free_port, _http, _model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_MODEL_LEN = 768
REPLICA_FLAGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--max-model-len",
                 str(MAX_MODEL_LEN), "--enable-chunked-prefill", "--num-pages", "640",
                 "--page-size", "16", "--metrics-port", "0", "--grace-period", "60"]


@dataclass
class Replica:
    process: ServeProcess
    port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10) as reply:
            text = reply.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and set(labels.items()) <= set(s.labels.items()))


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """The tiny random Llama with room for 512-token prefixes (1024 positions)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    out = tmp_path_factory.mktemp("long_llama")
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def replicas(long_llama_dir: Path) -> Iterator[list[Replica]]:
    processes = [ServeProcess(long_llama_dir, *REPLICA_FLAGS) for _ in range(2)]
    try:
        out = []
        for proc in processes:
            port = int(proc.wait_for_log(r"listening on [\d.]+:(\d+)").group(1))
            metrics = int(proc.wait_for_log(r"metrics on http://[\d.]+:(\d+)").group(1))
            proc.wait_for_log(r"\(SERVING\)", timeout=300)
            out.append(Replica(proc, port, metrics))
        yield out
    finally:
        for proc in processes:
            proc.stop()


@contextmanager
def smg(replicas: list[Replica], policy: str) -> Iterator[int]:
    port = _free_port()
    proc = subprocess.Popen(
        [str(SMG), "launch", "--worker-urls", *(r.url for r in replicas), "--policy", policy,
         "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(_free_port()), "--log-level", "warn",
         "--health-check-interval-secs", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, ready = _http(port, "GET", "/readiness", timeout=5)
                if status == 200 and ready["healthy_workers"] == len(replicas):
                    break
            except (OSError, ValueError):
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "smg did not come up"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def _complete(port: int, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    status, reply = _http(port, "POST", "/v1/completions", {
        "model": _model(port), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True}, timeout=120)
    assert status == 200, reply
    return dict(reply)


def _served(replicas: list[Replica]) -> list[float]:
    return [r.metric("vllm:request_success_total") for r in replicas]


_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "def", "return", "self")


def _prefix(tokenizer: Tokenizer, rng: random.Random, tokens: int = 512) -> str:
    """Random words cut to `tokens` tokens."""
    text = " ".join(rng.choice(_WORDS) + str(rng.randint(0, 99)) for _ in range(tokens))
    return str(tokenizer.decode(tokenizer.encode(text).ids[:tokens]))


def test_round_robin_spreads_requests(replicas: list[Replica]) -> None:
    before = _served(replicas)
    with smg(replicas, "round_robin") as port:
        for i in range(64):
            _complete(port, f"request {i}:")
    spread = [a - b for a, b in zip(_served(replicas), before, strict=True)]
    assert sum(spread) == 64 and min(spread) >= 24, spread


def _hit_rate(replicas: list[Replica], port: int, tokenizer: Tokenizer, seed: int) -> float:
    rng = random.Random(seed)
    groups = [_prefix(tokenizer, rng) for _ in range(8)]
    queries = [r.metric("vllm:prefix_cache_queries_total") for r in replicas]
    hits = [r.metric("vllm:prefix_cache_hits_total") for r in replicas]
    order = [g for g in range(8) for _ in range(8)]
    rng.shuffle(order)  # not i % 8: round robin would then pin each group by accident
    for i, group in enumerate(order):
        _complete(port, f"{groups[group]} question {i}:", max_tokens=2)
    dq = sum(r.metric("vllm:prefix_cache_queries_total") - q
             for r, q in zip(replicas, queries, strict=True))
    dh = sum(r.metric("vllm:prefix_cache_hits_total") - h
             for r, h in zip(replicas, hits, strict=True))
    return dh / dq


def test_cache_aware_routing_hits_the_prefix_cache_more(replicas: list[Replica],
                                                        long_llama_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(long_llama_dir / "tokenizer.json"))
    with smg(replicas, "round_robin") as port:
        round_robin = _hit_rate(replicas, port, tokenizer, seed=11)
    with smg(replicas, "cache_aware") as port:
        cache_aware = _hit_rate(replicas, port, tokenizer, seed=12)
    print(f"prefix-cache hit rate: round robin {round_robin:.3f}, cache aware {cache_aware:.3f}")
    assert cache_aware > round_robin + 0.05, (round_robin, cache_aware)


def test_envoy_spreads_streams_over_both_replicas(replicas: list[Replica],
                                                  tmp_path: Path) -> None:
    """Envoy's least-request balancing over the two replica processes, health-checked."""
    from service.client import EngineClient
    from tests.service.test_server_envoy import running_envoy

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = _served(replicas)
    with running_envoy(tmp_path, replicas[0].port, replicas[1].port) as envoy, \
            EngineClient(envoy.target, timeout=120) as proxied, ThreadPoolExecutor(8) as pool:
        def tokens(i: int) -> list[int]:
            return [t for m in proxied.generate([5, 6, 7, 8], params) for t in m.token_ids]

        outputs = list(pool.map(tokens, range(16)))
    spread = [a - b for a, b in zip(_served(replicas), before, strict=True)]
    assert all(o == outputs[0] and len(o) == 16 for o in outputs)  # same model, same tokens
    assert sum(spread) == 16 and min(spread) >= 2, spread


def _stream(port: int, i: int) -> str:
    """One streamed completion's outcome: "done", or the HTTP status of a refusal."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": _model(port), "prompt": f"stream {i}:", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "stream": True}),
            headers={"content-type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            return str(reply.status)
        body = reply.read().decode()
        return "done" if '"finish_reason":"length"' in body and "[DONE]" in body else "cut"
    finally:
        conn.close()


def test_sigterm_to_a_replica_under_load(replicas: list[Replica]) -> None:
    going, staying = replicas
    with smg(replicas, "round_robin") as port, ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(_stream, port, i) for i in range(24)]
        time.sleep(1.0)
        going.process.proc.send_signal(signal.SIGTERM)
        outcomes = [f.result(timeout=180) for f in futures]  # none hangs
        going.process.proc.wait(120)
        print("outcomes under SIGTERM:", {o: outcomes.count(o) for o in set(outcomes)})
        # Every stream finished, or was refused with a status a client can retry on.
        assert all(o == "done" or o in ("500", "502", "503", "504") for o in outcomes), outcomes
        assert outcomes.count("done") >= 12
        before = staying.metric("vllm:request_success_total")
        deadline = time.monotonic() + 30
        while _http(port, "GET", "/readiness")[1]["healthy_workers"] != 1:
            assert time.monotonic() < deadline, "smg kept the stopped replica"
            time.sleep(0.2)
        for i in range(8):
            _complete(port, f"after {i}:")
    assert staying.metric("vllm:request_success_total") - before == 8
