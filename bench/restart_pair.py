"""Start-up of two checkouts side by side: warm restarts (or cold starts),
alternating, with each side's median and the ratio.

    .venv/bin/python bench/restart_pair.py --base /path/to/other/checkout [--pairs 4] [--cold]
        [--model smollm2-135m-instruct]

Each start is `python -m service` with this checkout's interpreter and the
Makefile's SERVE_FLAGS, run from its checkout's directory (so its own
`esurge` and `service` packages load), timed from launch to SERVING, as in
bench/first_contact.py. Warm: both sides share one set of compile, kernel
and layout caches, filled by a start of each before timing. Cold: every start
gets empty caches. The order alternates each pair, so a machine that speeds
up or slows down during the run weighs on both sides alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.first_contact import start_server, stop  # noqa: E402


def timed_start(model: str, root: Path, caches: Path, log: Path, port: int) -> float:
    """Seconds from launch to SERVING of root's server over these caches."""
    env = {**os.environ, "ESURGE_COMPILE_CACHE": str(caches / "xla"),
           "ESURGE_KERNEL_CACHE": str(caches / "kernels"),
           "ESURGE_LAYOUT_CACHE": str(caches / "layouts"), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc, seconds = start_server(model, port, env, log, [], root=root)
    stop(proc)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--cold", action="store_true", help="empty caches for every start")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--port", type=int, default=50392)
    args = parser.parse_args()
    from esurge.packaged import resolve_model_path

    model = str(resolve_model_path(args.model))
    work = Path(tempfile.mkdtemp(prefix="esurge-restart-pair-"))
    sides = {"base": args.base.resolve(), "this": ROOT}
    if not args.cold:
        for name, root in sides.items():  # fill the shared caches
            timed_start(model, root, work / "shared", work / f"fill-{name}.log", args.port)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.pairs):
        for name in (sides if i % 2 == 0 else reversed(list(sides))):
            caches = work / (f"cold-{name}-{i}" if args.cold else "shared")
            seconds = timed_start(model, sides[name], caches, work / f"{name}-{i}.log", args.port)
            times[name].append(seconds)
            print(f"{name}: SERVING after {seconds:.1f}s", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name} ({sides[name]}): median {medians[name]:.1f}s "
              f"(runs {[round(v, 1) for v in values]})")
    print(f"{'cold starts' if args.cold else 'warm restarts'}: this / base = "
          f"{medians['this'] / medians['base']:.2f} (logs: {work})")


if __name__ == "__main__":
    main()
