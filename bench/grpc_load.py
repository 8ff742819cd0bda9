"""Serving overhead: N concurrent gRPC streaming clients against the in-process engine.

Workload W1: 32 prompts of 64-128 tokens cut from the standard library's source
with the model's tokenizer, 64 new tokens each, greedy, ignore_eos. The model
is a random-initialised Llama (hidden 256, 4 layers, 4 heads, 2 KV heads,
vocab 4096) with a 4096-token BPE tokenizer trained here; both are built in a
temp dir. For each N in --clients, max(N, 32) requests (W1 repeated) are run

- in process: the engine's best mode, `eSurge.generate` given all the
  requests at once (the same for every N), and
- over gRPC: N asyncio streaming clients (one channel each, or --channels
  shared ones) against
  `python -m service` running the same engine configuration in its own process,

and the script prints time to first token and inter-token latency (p50/p99,
gRPC side), generated tokens/s of both and their ratio (goal: >= 0.9 at 64),
and the serving process's CPU time per generated token (the server's, read
from /proc; the engine's in process) and its ratio (goal: <= 1.1), and the
tokens per stream message (above 1 with decode bursts, --decode-steps, or
when a stream fell behind and joins the steps it missed), and the clients'
CPU per token, all from the best of --repeats runs; then the two ratios of
each repeat (its in-process and gRPC runs back to back) as a median and
range. --rounds R sends R times as many requests per run, so that a run's
start (requests arriving, prefills) and end (the last stragglers) weigh
less in its rates. The clients connect before the clock starts. The load-generating
clients run in this process, on the same cores: wall tokens/s is shared
with them, server CPU per token is not.
`bench/grpc_floor.py` measures grpcio's own cost per call and per message,
the part of the difference no service code can remove. --engine-streams S
sends the same load over S EngineStream calls instead (each keeps its share
of the N requests in flight, one message per engine step for all of them):
what a gateway that multiplexes requests pays, without a call per request.
Both engines share a JAX compilation cache, so the server warms up quickly.

    .venv/bin/python bench/grpc_load.py [--clients 1,16,64] [--decode-steps K]
        [--max-num-batched-tokens B] [--engine-streams S] [--rounds R] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPTS, MIN_LEN, MAX_LEN, NEW_TOKENS = 32, 64, 128, 64
ENGINE_FLAGS = ["--max-num-seqs", "64", "--max-model-len",
                "256", "--enable-chunked-prefill", "--num-pages", "1100", "--page-size", "16",
                "--max-num-seq-buckets", "4,16,64", "--max-queued-requests", "1024"]


def build_model(out: Path) -> Path:
    """The random Llama and its freshly trained 4096-token tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.tokenizer_training import stdlib_texts, train_bpe_tokenizer

    if (out / "config.json").is_file():
        return out
    train_bpe_tokenizer(stdlib_texts(max_files=120), vocab_size=4096, out_dir=out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    return out


def w1_prompts(model_dir: Path) -> list[list[int]]:
    """32 token windows of 64-128 tokens from standard-library files not trained on."""
    from tokenizers import Tokenizer

    from tools.tokenizer_training import stdlib_texts

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [t for text in stdlib_texts(max_files=8, skip=150) for t in tokenizer.encode(text).ids]
    prompts, at = [], 0
    for i in range(PROMPTS):
        length = MIN_LEN + (i * 37) % (MAX_LEN - MIN_LEN + 1)
        prompts.append(ids[at:at + length])
        at += length + 11
    if any(len(p) < MIN_LEN for p in prompts):
        raise ValueError("the standard library sample is too short for W1")
    return prompts


def engine_setup(flags: list[str]) -> tuple[object, object]:
    """The Config and EngineSettings the CLI builds from these flags (one source of truth)."""
    from service.cli_args import build_config, build_parser, build_settings

    args = build_parser().parse_args(["--model", str(REPO), *flags])
    config = build_config(args, 2048)
    assert config is not None
    return config, build_settings(args, config)


@dataclass
class Result:
    tokens: int
    seconds: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU seconds of the serving process (the engine's, or the server's)
    client_cpu_s: float = 0.0  # CPU seconds of this process's clients (gRPC side)
    messages: int = 0  # stream messages that carried tokens (gRPC side)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_us_per_token(self) -> float:
        return 1e6 * self.cpu_s / self.tokens


# One repeat's runs, back to back: (in process, over gRPC).
Pair = tuple[Result, Result]


def in_process(engine: object, requests: list[list[int]], clients: int) -> Result:
    """The engine's best mode: `eSurge.generate` given all the requests at once.

    `clients` does not change it (the engine batches what it is given); it is
    the baseline each gRPC client count is compared with. cpu_s is this
    process's CPU time, the engine's alone (no client runs meanwhile).
    """
    from esurge.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(requests, params)  # type: ignore[attr-defined]
    result = Result(sum(len(o.outputs[0].token_ids) for o in outs),
                    time.perf_counter() - start)
    result.cpu_s = time.process_time() - cpu
    return result


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _StreamTimes:
    """Per-request token arrival times, for TTFT and inter-token latency."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.began: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def added(self, request_id: str) -> None:
        self.began[request_id] = self.last[request_id] = time.perf_counter()

    def tokens(self, request_id: str, count: int, now: float) -> None:
        if self.last[request_id] == self.began[request_id]:
            self.result.ttft.append(now - self.began[request_id])
        else:
            gap = (now - self.last[request_id]) / count
            self.result.itl.extend([gap] * count)
        self.last[request_id] = now
        self.result.tokens += count


async def _timed(pool: list[Any], server_pid: int, result: Result,
                 load: Callable[[], Awaitable[object]]) -> Result:
    """Run `load` over connected channels; wall time and both sides' CPU of the run only.

    The channels connect first, outside the clock: a client or gateway in
    production keeps its connections, so TCP and HTTP/2 set-up is not
    serving cost.
    """
    try:
        await asyncio.gather(*(client.channel.channel_ready() for client in pool))
        cpu, own = process_cpu_s(server_pid), time.process_time()
        start = time.perf_counter()
        await load()
        result.seconds = time.perf_counter() - start
        result.cpu_s = process_cpu_s(server_pid) - cpu
        result.client_cpu_s = time.process_time() - own
    finally:
        for client in pool:
            await client.close()
    return result


async def over_grpc(target: str, server_pid: int, requests: list[list[int]], clients: int,
                    channels: int | None = None) -> Result:
    """N streaming clients sharing the request list, over `channels` HTTP/2
    connections (None: one each; a gateway multiplexes many streams on few)."""
    from esurge.sampling_params import SamplingParams
    from service.client import AsyncEngineClient

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    work: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in requests:
        work.put_nowait(prompt)
    result = Result(0, 0.0)
    times = _StreamTimes(result)

    async def one(client: AsyncEngineClient, prompt: list[int]) -> None:
        key = str(len(times.began))
        times.added(key)
        async for message in client.generate(prompt, params, return_text=False):
            if message.token_ids:
                times.tokens(key, len(message.token_ids), time.perf_counter())
                result.messages += 1

    async def worker(client: AsyncEngineClient) -> None:
        while not work.empty():
            await one(client, work.get_nowait())

    pool = [AsyncEngineClient(target, timeout=600) for _ in range(channels or clients)]
    return await _timed(pool, server_pid, result, lambda: asyncio.gather(
        *(worker(pool[i % len(pool)]) for i in range(clients))))


async def over_engine_streams(target: str, server_pid: int, requests: list[list[int]],
                              clients: int, streams: int) -> Result:
    """The same load multiplexed as a gateway would: `streams` EngineStream calls
    (one channel each), each keeping clients // streams requests in flight and
    adding the next one when one finishes; one message per engine step per stream."""
    import grpc

    from esurge.sampling_params import SamplingParams
    from generated.esurge.v1 import service_pb2
    from service.client import AsyncEngineClient, build_request

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    work = list(enumerate(requests))[::-1]  # popped from the end: request order
    result = Result(0, 0.0)
    times = _StreamTimes(result)

    async def add(call: Any) -> bool:
        if not work:
            return False
        index, prompt = work.pop()
        request_id = f"bench-{index}"
        times.added(request_id)
        await call.write(service_pb2.EngineStreamRequest(add_request=build_request(
            prompt, params, request_id=request_id, return_text=False)))
        return True

    async def stream(client: AsyncEngineClient, width: int) -> None:
        call = client.engine_stream()
        live = 0
        for _ in range(width):
            live += await add(call)
        while live:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise RuntimeError("the EngineStream ended with requests in flight")
            if response.WhichOneof("payload") != "outputs":
                raise RuntimeError(f"a request was refused: {response.rejection.message}")
            now = time.perf_counter()
            result.messages += 1
            for out in response.outputs.outputs:
                if out.new_token_ids:
                    times.tokens(out.request_id, len(out.new_token_ids), now)
            for _ in response.outputs.finished_requests:
                live -= 1
                live += await add(call)
        await call.done_writing()

    pool = [AsyncEngineClient(target, timeout=600) for _ in range(streams)]
    widths = [clients // streams + (i < clients % streams) for i in range(streams)]
    return await _timed(pool, server_pid, result, lambda: asyncio.gather(
        *(stream(c, w) for c, w in zip(pool, widths, strict=True))))


def start_server(model_dir: Path, env: dict[str, str], flags: list[str]
                 ) -> tuple[subprocess.Popen[str], str]:
    """`python -m service` on a free port; returns once it reports SERVING."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--model", str(model_dir), "--port", "0",
         "--log-level", "info", *flags], cwd=REPO, env=env, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    port = None
    for line in proc.stderr:
        found = re.search(r"listening on [^:]+:(\d+)", line)
        port = int(found.group(1)) if found else port
        if "(SERVING)" in line:
            break
    else:
        raise RuntimeError(f"the server exited with status {proc.wait()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    return proc, f"127.0.0.1:{port}"


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, in milliseconds."""
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(engine: object, target: str, server_pid: int, prompts: list[list[int]],
            counts: list[int], repeats: int, channels: int | None,
            engine_streams: int | None = None, rounds: int = 1
            ) -> tuple[dict[int, Result], dict[int, Result], dict[int, list[Pair]]]:
    """Best of `repeats` runs per client count, local and gRPC runs interleaved so
    that load from other processes on the machine hits both alike (the gRPC side
    over Generate calls, or over `engine_streams` EngineStream calls). Also each
    repeat's pair (local, gRPC), run back to back, for paired ratios."""
    in_process(engine, prompts[:4], 4)  # first-call effects out of the numbers
    asyncio.run(over_grpc(target, server_pid, prompts[:4], 4))
    local: dict[int, Result] = {}
    remote: dict[int, Result] = {}
    pairs: dict[int, list[Pair]] = {}
    for n in counts:
        requests = [prompts[i % PROMPTS] for i in range(rounds * max(n, PROMPTS))]
        for _ in range(repeats):
            lo = in_process(engine, requests, n)
            r = asyncio.run(
                over_engine_streams(target, server_pid, requests, n, min(engine_streams, n))
                if engine_streams else over_grpc(target, server_pid, requests, n, channels))
            if r.tokens != len(requests) * NEW_TOKENS:  # a rate over lost tokens is no rate
                raise RuntimeError(f"the gRPC side received {r.tokens} tokens, expected "
                                   f"{len(requests) * NEW_TOKENS}")
            pairs.setdefault(n, []).append((lo, r))
            if n not in local or lo.tokens_per_s > local[n].tokens_per_s:
                local[n] = lo
            if n not in remote or r.tokens_per_s > remote[n].tokens_per_s:
                remote[n] = r
        print(f"  {n} clients: local {local[n].tokens_per_s:.0f}, gRPC "
              f"{remote[n].tokens_per_s:.0f} tok/s", flush=True)
    return local, remote, pairs


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(counts: list[int], local: dict[int, Result], remote: dict[int, Result],
           pairs: dict[int, list[Pair]]) -> None:
    """The results table (best runs; CPU is µs of the serving process's CPU per
    generated token), then each repeat's ratios, the two runs back to back."""
    print(f"{'clients':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'gRPC tok/s':>10} {'local tok/s':>11} {'ratio':>6} {'gRPC CPU':>9} "
          f"{'local CPU':>9} {'ratio':>6} {'tok/msg':>7} {'client CPU':>10}")
    for n in counts:
        r, lo = remote[n], local[n]
        print(f"{n:>7} {percentile(r.ttft, .5):>7.1f}ms {percentile(r.ttft, .99):>7.1f}ms "
              f"{percentile(r.itl, .5):>6.1f}ms {percentile(r.itl, .99):>6.1f}ms "
              f"{r.tokens_per_s:>10.0f} {lo.tokens_per_s:>11.0f} "
              f"{r.tokens_per_s / lo.tokens_per_s:>6.2f} {r.cpu_us_per_token:>7.0f}us "
              f"{lo.cpu_us_per_token:>7.0f}us {r.cpu_us_per_token / lo.cpu_us_per_token:>6.2f} "
              f"{r.tokens / max(r.messages, 1):>7.2f} {1e6 * r.client_cpu_s / r.tokens:>8.0f}us")
    for n in counts:
        speed = [g.tokens_per_s / lo.tokens_per_s for lo, g in pairs[n]]
        cpu = [g.cpu_us_per_token / lo.cpu_us_per_token for lo, g in pairs[n]]
        print(f"{n:>7} clients, {len(speed)} repeats, each pair back to back: tok/s ratio "
              f"median {_spread(speed)}, CPU ratio median {_spread(cpu)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--keep", type=Path, default=None,
                        help="build the model (and the JAX cache) here and keep them "
                             "(default: a temp dir)")
    parser.add_argument("--decode-steps", type=int, default=1,
                        help="decode bursts for both engines (esurge-serve --decode-steps)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="token budget per step for both engines; a burst of K steps "
                             "over 64 rows needs 64 K (512 for --decode-steps 8)")
    parser.add_argument("--channels", type=int, default=None,
                        help="HTTP/2 connections the clients share (default: one each)")
    parser.add_argument("--engine-streams", type=int, default=None,
                        help="send the load over this many EngineStream calls (the "
                             "requests multiplexed, as a gateway does) instead of one "
                             "Generate call per request")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per client count; the best is reported")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each run sends W1 this many times over (rounds * max(N, 32) "
                             "requests): longer runs, less of the start and end in the rates")
    args = parser.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds and --repeats must be >= 1, got {args.rounds} and "
                     f"{args.repeats}")
    counts = [int(c) for c in args.clients.split(",")]
    work_dir = Path(tempfile.mkdtemp(prefix="grpc_load_"))
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "JAX_COMPILATION_CACHE_DIR": str((args.keep or work_dir) / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    os.environ.update(env)  # before JAX is imported: this process fills the cache
    try:
        model_dir = build_model(args.keep or work_dir / "model")
        prompts = w1_prompts(model_dir)
        from esurge.engine.api import eSurge

        flags = [*ENGINE_FLAGS, "--decode-steps", str(args.decode_steps),
                 "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        config, settings = engine_setup(flags)
        engine = eSurge(model_dir, config, settings=settings,  # type: ignore[arg-type]
                        show_progress=False)
        print(f"model ready, warm-up {engine.warmup_seconds:.1f}s; W1: {len(prompts)} prompts "
              f"of {min(map(len, prompts))}-{max(map(len, prompts))} tokens", flush=True)
        proc, target = start_server(model_dir, env, flags)
        try:
            local, remote, pairs = measure(engine, target, proc.pid, prompts, counts,
                                           args.repeats, args.channels, args.engine_streams,
                                           args.rounds)
        finally:
            proc.terminate()
            proc.wait(120)
            engine.shutdown()
        report(counts, local, remote, pairs)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
