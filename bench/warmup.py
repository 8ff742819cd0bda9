"""Warm-up programs and their seconds: the count and time a start spends compiling.

    .venv/bin/python bench/warmup.py [--model tiny] [--buckets 4,16] [--runs 2]
        [--cache DIR]

--model is `tiny` (the 4M test model, built here by bench.common), a
packaged model's name (smollm2-135m-instruct) or a checkpoint path. With
--buckets the engine takes make serve's shape (16 requests, 256-token steps,
context 2048, those request buckets); without, the config eSurge derives.
The first run compiles into an empty cache (a fresh temporary directory,
unless --cache names one), the later runs read it back (a warm restart's
warm-up), each in its own process. Per run: the program count, the seconds,
and the seconds per program family (model steps, samplers, logprobs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from esurge import Config

ROOT = Path(__file__).resolve().parents[1]


def _engine_config(buckets: str | None) -> Config | None:
    from esurge import CacheConfig, Config, SchedulerConfig

    if not buckets:
        return None
    return Config(SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048,
        chunked_prefill_enabled=True, async_scheduling=True,
        max_num_seq_buckets=tuple(int(b) for b in buckets.split(","))),
        CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=True))


def _model_path(model: str, work: Path) -> Path:
    if model == "tiny":
        from bench.common import make_checkpoint

        return make_checkpoint(work / "tiny", "tiny")
    from esurge.packaged import resolve_model_path

    return Path(resolve_model_path(model))


def measure(model: str, buckets: str | None, work: Path) -> dict[str, object]:
    """One warm-up in this process: program count, seconds, seconds per family."""
    from esurge import eSurge

    llm = eSurge(_model_path(model, work), _engine_config(buckets), show_progress=False,
                 warmup=False)
    families: dict[str, float] = defaultdict(float)
    last, count = [time.perf_counter()], [0]

    def progress(done: int, total: int, label: str) -> None:
        now = time.perf_counter()
        families[" ".join(w for w in label.split()[:2] if "=" not in w)] += now - last[0]
        last[0], count[0] = now, total

    seconds = llm.runner.warmup(progress)
    return {"programs": count[0], "seconds": round(seconds, 2),
            "families": {k: round(v, 2) for k, v in families.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--buckets", default=None, help="make serve's request buckets, e.g. 4,16")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None, help="compile cache (default: empty)")
    parser.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.work is not None:  # a child: one warm-up, its result as JSON
        sys.path.insert(0, str(ROOT))
        print(json.dumps(measure(args.model, args.buckets, args.work)), flush=True)
        os._exit(0)  # skip the engine's shutdown: only the warm-up is measured
    work = Path(tempfile.mkdtemp(prefix="esurge-warmup-"))
    env = {**os.environ, "ESURGE_COMPILE_CACHE": str(args.cache or work / "xla")}
    cmd = [sys.executable, __file__, "--model", args.model, "--work", str(work)]
    if args.buckets:
        cmd += ["--buckets", args.buckets]
    for run in range(args.runs):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        kind = "cold" if run == 0 and args.cache is None else "from the cache"
        print(f"run {run + 1} ({kind}): {result['programs']} programs in {result['seconds']}s;"
              f" {result['families']}", flush=True)


if __name__ == "__main__":
    main()
