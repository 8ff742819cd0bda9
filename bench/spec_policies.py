"""Speculation policies side by side in one Eagle engine: no drafts, "always"
and "adaptive", each set of prompts run by all three in turn (the order
rotating), so that prompt difficulty and the machine's drift hit them alike.

How often a head's drafts are accepted is mostly a property of the prompt
(SmolLM2's head on held-out chats: 1.5 to 4.2 tokens a verification), so a
verdict needs many prompts: --sets sets of --batch prompts each, 128 new
tokens, greedy, ignore_eos. "plain" is the same engine with a policy that
never drafts (the Eagle runner's plain steps); bench/spec_decode.py compares
against an engine without a head. The adaptive policy keeps what it learnt
across its sets (as a serving engine would); "always" and "plain" have
nothing to learn. Prints per-set tokens/s, then per policy the overall
rate, its time against plain's over all sets, and the median, geometric
mean and minimum of its per-set ratios to plain.

    .venv/bin/python bench/spec_policies.py [--batch 1] [--sets 24]
        [--model smollm2-135m-instruct --head models/smollm2-eagle --prompts chat]
        [--buckets 4,16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.spec_decode import (  # noqa: E402
    NEW_TOKENS,
    chat_prompts,
    held_out_prompts,
    make_engine,
    random_prompts,
)

MODES = ("plain", "always", "adaptive")


def policies(llm: Any) -> dict[str, Any]:
    """The three policies; the adaptive one is the engine's own (calibrated at warm-up)."""
    from esurge.spec_decode.policy import SpeculationPolicy

    class Never(SpeculationPolicy):
        def speculate(self, batch: int, measurable: bool = True) -> bool:
            return False

    return {"plain": Never(), "always": SpeculationPolicy(), "adaptive": llm.runner.spec.policy}


def run(args: argparse.Namespace) -> dict[str, list[tuple[int, float]]]:
    """(tokens, seconds) per set, per policy."""
    from esurge import SamplingParams
    from esurge.packaged import resolve_model_path

    model = resolve_model_path(args.model)  # a packaged model's name, or a path
    make = {"stdlib": held_out_prompts, "random": random_prompts, "chat": chat_prompts}
    prompts = make[args.prompts](model, args.batch * (args.sets + 1), args.seed)
    buckets = sorted(int(b) for b in args.buckets.split(","))
    llm = make_engine(model, Path(args.head), args.k, buckets, args.dtype, "adaptive", True)
    spec, chosen = llm.runner.spec, policies(llm)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    spec.policy = chosen["plain"]
    llm.generate(prompts[:args.batch], params)  # untimed
    results: dict[str, list[tuple[int, float]]] = {m: [] for m in MODES}
    for i in range(args.sets):
        batch = prompts[args.batch * (i + 1):args.batch * (i + 2)]
        for mode in MODES[i % 3:] + MODES[:i % 3]:
            spec.policy = chosen[mode]
            began = time.perf_counter()
            outs = llm.generate(batch, params)
            seconds = time.perf_counter() - began
            results[mode].append((sum(len(o.outputs[0].token_ids) for o in outs), seconds))
        print(f"set {i}: " + ", ".join(f"{m} {t / s:.1f}" for m in MODES
                                       for t, s in results[m][-1:]) + " tok/s",
              file=sys.stderr, flush=True)
    llm.shutdown()
    return results


def report(results: dict[str, list[tuple[int, float]]]) -> None:
    plain = results["plain"]
    print("| policy | tok/s | time vs plain | per set vs plain: median | geo. mean | min |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        sets = results[mode]
        rate = sum(t for t, _ in sets) / sum(s for _, s in sets)
        time_ratio = sum(s for _, s in plain) / sum(s for _, s in sets)
        ratios = [(t / s) / (tp / sp) for (t, s), (tp, sp) in zip(sets, plain, strict=True)]
        geo = math.exp(statistics.mean(math.log(r) for r in ratios))
        print(f"| {mode} | {rate:.1f} | {time_ratio:.3f}x | {statistics.median(ratios):.3f}x "
              f"| {geo:.3f}x | {min(ratios):.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--head", default=str(REPO / "models/smollm2-eagle"))
    parser.add_argument("--prompts", choices=("chat", "stdlib", "random"), default="chat")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sets", type=int, default=24)
    parser.add_argument("--buckets", default="4,16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.batch < 1 or args.sets < 1:
        raise SystemExit("--batch and --sets must be >= 1")
    report(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
