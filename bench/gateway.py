"""The smg gateway's cost: the same streamed requests straight to eSurge over gRPC
and through smg (OpenAI `/v1/completions`, SSE), in the same run.

One `python -m service` process (default model models/tiny-stdlib; async
scheduling, 64 sequences, chunked prefill) and `smg launch` in front of it,
speaking vLLM's engine protocol. Workload W1 (bench/common.py: 32 prompts of
64-128 tokens cut from the standard library's source) decoded to TEXT, greedy,
64 new tokens each with ignore_eos, so both paths generate the same tokens. For
each N in --clients, max(N, 32) requests (W1 repeated), N clients each issuing
its requests back to back, run

- direct: N asyncio `AsyncEngineClient`s (one channel each), esurge.v1 `Generate`
  streaming with return_text, tokens counted from the messages' token ids;
- gateway: N asyncio HTTP/1.1 keep-alive connections to smg, `"stream": true`
  with `stream_options.include_usage`, tokens from the final `usage` chunk
  (checked against the direct count for every request),

the two in alternating order over --reps repetitions; the medians are reported.
TTFT: request sent to the first message carrying tokens (direct) or the first
data event with non-empty text (gateway). ITL: the gap between consecutive such
messages/events, per message (not divided by tokens per message; the tok/msg
column shows how many each carried). CPU: µs of CPU per generated token of the
server, smg and this load generator (/proc). All three share the machine's
cores: wall tokens/s is a whole-machine number.

    .venv/bin/python bench/gateway.py [--model DIR] [--clients 1,16,64] [--reps 3]
        [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.http_client import HttpConnection, http_json, read_all, sse_events

REPO = Path(__file__).resolve().parents[1]

SMG = Path(sys.executable).with_name("smg")
NEW_TOKENS, MIN_REQUESTS = 64, 32
REQUEST_TIMEOUT, PASS_TIMEOUT, START_TIMEOUT = 120.0, 300.0, 600.0
ENGINE_FLAGS = ["--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--max-model-len",
                "256", "--enable-chunked-prefill", "--async-scheduling", "--num-pages", "1100",
                "--page-size", "16", "--max-num-seq-buckets", "4,16,64",
                "--max-queued-requests", "1024"]


@dataclass
class Pass:
    """One path's run of one request set."""

    path: str
    clients: int
    seconds: float = 0.0
    per_request: list[int] = field(default_factory=list)  # generated tokens of each
    messages: int = 0  # token-carrying messages / non-empty-text events
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # server, smg, client

    @property
    def tokens(self) -> int:
        return sum(self.per_request)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Ticker:
    """Timestamps of one request's token-carrying messages."""

    began: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def tick(self, result: Pass) -> None:
        now = time.perf_counter()
        (result.ttft if self.last is None else result.itl).append(
            now - (self.began if self.last is None else self.last))
        self.last = now
        result.messages += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def w1_texts(model_dir: Path) -> list[str]:
    """W1's 32 prompts, decoded to text with the model's tokenizer."""
    from tokenizers import Tokenizer

    from bench.common import workload_w1

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.decode(p) for p in workload_w1(model_dir, 1, MIN_REQUESTS)[0]]


# --- processes -------------------------------------------------------------------------

def wait_log(log: Path, proc: subprocess.Popen[bytes], pattern: str,
             timeout: float) -> re.Match[str]:
    """The first match of pattern in a process's log file; RuntimeError if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found is not None:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"{log.stem} exited ({proc.returncode}): "
                               f"{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"no {pattern!r} in {log} within {timeout:.0f}s")


def start_server(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`python -m service` on a free port; returns once it reports SERVING."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--model", str(model), "--port", "0",
             "--log-level", "info", *ENGINE_FLAGS], cwd=REPO, env=env,
            stdout=subprocess.DEVNULL, stderr=out)
    try:
        port = int(wait_log(log, proc, r"listening on [\d.]+:(\d+)", START_TIMEOUT).group(1))
        wait_log(log, proc, r"\(SERVING\)", START_TIMEOUT)
    except BaseException:
        stop(proc)
        raise
    return proc, port


def start_smg(server_port: int, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """smg routing to the server; returns once /readiness shows the worker healthy."""
    if not SMG.is_file():
        raise SystemExit(f"no smg at {SMG} (make install puts it in the venv)")
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(SMG), "launch", "--worker-urls", f"grpc://127.0.0.1:{server_port}",
             "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--log-level", "warn"],
            stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + 60
    while True:
        try:
            status, ready = asyncio.run(http_json(port, "GET", "/readiness"))
            if status == 200 and ready.get("healthy_workers", 0) >= 1:
                return proc, port
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"smg did not come up: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes], grace: float = 60) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# --- a minimal asyncio HTTP/1.1 client (SSE over chunked transfer encoding) ------------

async def direct_one(client: Any, prompt: str, params: Any, result: Pass) -> None:
    """One streamed esurge.v1 Generate; tokens from the messages' token ids."""
    ticker, tokens = Ticker(), 0
    async for message in client.generate(prompt, params, timeout=REQUEST_TIMEOUT):
        if message.token_ids:
            ticker.tick(result)
            tokens += len(message.token_ids)
    result.per_request.append(tokens)


async def gateway_one(conn: HttpConnection, body: dict[str, Any], result: Pass) -> None:
    """One streamed /v1/completions through smg; tokens from the final usage chunk."""
    ticker, tokens = Ticker(), None
    status, reply = await conn.request("POST", "/v1/completions", body)
    if status != 200:
        await conn.close()
        raise RuntimeError(f"smg answered {status}: {(await read_all(reply))[:500]!r}")
    async for event in sse_events(reply):
        if event.get("usage"):
            tokens = int(event["usage"]["completion_tokens"])
        if any(choice.get("text") for choice in event.get("choices") or []):
            ticker.tick(result)
    if tokens is None:
        raise RuntimeError("smg sent no usage chunk despite stream_options.include_usage")
    result.per_request.append(tokens)


def completion_body(model: str, prompt: str) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def run_pass(path: str, target: int, model: str, prompts: list[str],
                   clients: int) -> Pass:
    """N clients, each taking the next request from the shared list when done."""
    from esurge.sampling_params import SamplingParams
    from service.client import AsyncEngineClient

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    work: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        work.put_nowait(prompt)
    result = Pass(path, clients)

    async def worker() -> None:
        if path == "direct":
            async with AsyncEngineClient(f"127.0.0.1:{target}") as client:
                while not work.empty():
                    await direct_one(client, work.get_nowait(), params, result)
            return
        conn = HttpConnection(target)
        try:
            while not work.empty():
                body = completion_body(model, work.get_nowait())
                await asyncio.wait_for(gateway_one(conn, body, result), REQUEST_TIMEOUT)
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(clients))), PASS_TIMEOUT)
    result.seconds = time.perf_counter() - start
    return result


def measured(run: Coroutine[Any, Any, Pass], pids: dict[str, int]) -> Pass:
    """The pass `run` makes, with the CPU time each process spent during it."""
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    client = time.process_time()
    result = asyncio.run(run)
    result.cpu_s = {name: process_cpu_s(pid) - before[name] for name, pid in pids.items()}
    result.cpu_s["client"] = time.process_time() - client
    return result


# --- checks, measurement, report -------------------------------------------------------

async def check_once(server_port: int, smg_port: int, prompt: str) -> str:
    """smg's model name, after one non-streamed call through smg that must equal ours."""
    from esurge.sampling_params import SamplingParams
    from service.client import AsyncEngineClient

    _, models = await http_json(smg_port, "GET", "/v1/models")
    model = str(models["data"][0]["id"])
    body = {**completion_body(model, prompt), "stream": False}
    del body["stream_options"]
    status, reply = await http_json(smg_port, "POST", "/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"smg answered {status}: {reply}")
    async with AsyncEngineClient(f"127.0.0.1:{server_port}", timeout=REQUEST_TIMEOUT) as c:
        ours = (await c.generate_unary(prompt, SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))).completions[0]
    theirs = reply["choices"][0]
    if (reply["usage"]["completion_tokens"], len(ours.token_ids)) != (NEW_TOKENS, NEW_TOKENS):
        raise RuntimeError(f"token counts: smg {reply['usage']}, ours {len(ours.token_ids)}")
    if theirs["text"] != ours.text:
        print(f"WARNING: smg's text differs from ours: {theirs['text']!r} vs {ours.text!r}")
    return model


def measure(ports: dict[str, int], pids: dict[str, int], model: str, prompts: list[str],
            counts: list[int], reps: int, deadline: float) -> list[Pass]:
    """Every (N, rep) pass of both paths, direct first on even reps, gateway on odd."""
    results: list[Pass] = []
    for n in counts:
        requests = [prompts[i % len(prompts)] for i in range(max(n, MIN_REQUESTS))]
        for rep in range(reps):
            if time.monotonic() > deadline:
                print(f"  --deadline reached: N={n} rep {rep} and later skipped")
                return results
            order = ("direct", "gateway") if rep % 2 == 0 else ("gateway", "direct")
            for path in order:
                results.append(measured(run_pass(path, ports[path], model, requests, n), pids))
            pair = {r.path: r for r in results[-2:]}
            mismatched = [a for a in pair["direct"].per_request + pair["gateway"].per_request
                          if a != NEW_TOKENS]
            print(f"  N={n:<3} rep {rep}: direct {pair['direct'].tokens_per_s:6.0f} tok/s, "
                  f"gateway {pair['gateway'].tokens_per_s:6.0f} tok/s"
                  + (f"  {len(mismatched)} REQUESTS NOT {NEW_TOKENS} TOKENS: {mismatched[:8]}"
                     if mismatched else ""), flush=True)
    return results


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, in milliseconds."""
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(passes: list[Pass]) -> dict[str, float]:
    """Medians over repetitions of one (N, path)."""
    def med(fn: Callable[[Pass], float]) -> float:
        return statistics.median(fn(p) for p in passes)

    return {"tokens_per_s": med(lambda p: p.tokens_per_s),
            "ttft_p50_ms": med(lambda p: pct(p.ttft, .5)),
            "ttft_p99_ms": med(lambda p: pct(p.ttft, .99)),
            "itl_p50_ms": med(lambda p: pct(p.itl, .5)),
            "itl_p99_ms": med(lambda p: pct(p.itl, .99)),
            "tokens_per_message": med(lambda p: p.tokens / max(1, p.messages)),
            **{f"cpu_us_per_token_{k}": statistics.median(1e6 * p.cpu_s[k] / p.tokens
                                                          for p in passes)
               for k in ("server", "smg", "client")}}


def report(results: list[Pass], counts: list[int]) -> dict[str, Any]:
    """Print the table; returns the same numbers for --json."""
    print(f"\n{'N':>3} {'path':<8} {'tok/s':>6} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
          f"{'p99':>7} {'tok/msg':>7} {'CPU us/tok srv/smg/cli':>23} {'ratio':>6}")
    table: dict[str, Any] = {}
    for n in counts:
        rows = {path: summary([r for r in results if r.clients == n and r.path == path])
                for path in ("direct", "gateway")
                if any(r.clients == n and r.path == path for r in results)}
        if len(rows) < 2:
            continue
        ratio = rows["gateway"]["tokens_per_s"] / rows["direct"]["tokens_per_s"]
        for path, s in rows.items():
            cpu = "/".join(f"{s[f'cpu_us_per_token_{k}']:.0f}" for k in ("server", "smg", "client"))
            print(f"{n:>3} {path:<8} {s['tokens_per_s']:>6.0f} {s['ttft_p50_ms']:>7.1f}ms "
                  f"{s['ttft_p99_ms']:>6.1f}ms {s['itl_p50_ms']:>6.1f}ms {s['itl_p99_ms']:>5.1f}ms "
                  f"{s['tokens_per_message']:>7.2f} {cpu:>23} "
                  + (f"{ratio:>6.2f}" if path == "gateway" else f"{'':>6}"))
        table[str(n)] = {**rows, "gateway_over_direct_tokens_per_s": ratio}
    print("ratio: gateway/direct tokens/s (goal >= 0.9 at 64 streams)")
    return table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-stdlib")
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; medians reported")
    parser.add_argument("--quick", action="store_true", help="--reps 2 (a smoke run)")
    parser.add_argument("--deadline", type=float, default=1200,
                        help="seconds after which no new pass starts")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    if args.quick:
        args.reps = 2
    return args


def main() -> None:
    args = parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    deadline = time.monotonic() + args.deadline
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores usable; the load "
          "generator (this process), the server and smg share them", flush=True)
    prompts, logs = w1_texts(args.model), Path(tempfile.mkdtemp(prefix="bench_gateway_"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        server, server_port = start_server(args.model, logs / "server.log")
        procs.append(server)
        smg, smg_port = start_smg(server_port, logs / "smg.log")
        procs.append(smg)
        model = asyncio.run(check_once(server_port, smg_port, prompts[0]))
        print(f"server on :{server_port}, smg on :{smg_port} (model {model!r}); W1 as text: "
              f"{len(prompts)} prompts; {NEW_TOKENS} new tokens each", flush=True)
        ports, pids = {"direct": server_port, "gateway": smg_port}, {
            "server": server.pid, "smg": smg.pid}
        for path in ports:  # first-call effects out of the numbers
            asyncio.run(run_pass(path, ports[path], model, prompts[:8], 8))
        results = measure(ports, pids, model, prompts, counts, args.reps, deadline)
    finally:
        for proc in reversed(procs):
            stop(proc)
        shutil.rmtree(logs, ignore_errors=True)
    table = report(results, counts)
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "reps": args.reps, "summary": table,
                                         "passes": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
