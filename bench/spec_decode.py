"""Eagle speculative decoding: generated tokens/s with and without it, same run.

The default model (models/tiny-stdlib) with and without its Eagle head
(models/tiny-stdlib-eagle), greedy, ignore_eos, in --dtype (default
float32; auto would serve the bfloat16 checkpoint natively where the CPU has
AVX512_BF16): batches of 1, 4 and 16
prompts of 128 tokens cut from held-out standard-library files, 128 new
tokens each. Both engines are warmed up fully (no compile while timed) and
the prefix cache is off, so every timed set does its whole prefill. For each
batch size the two engines run alternately, --repeats times each, on fresh
prompts; the best time of each is reported (the machine may be shared), with
the Eagle engine's mean acceptance length over its timed runs.

    .venv/bin/python bench/spec_decode.py [--k 4] [--repeats 2] [--batches 1,4,16]
        [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NEW_TOKENS = 128
PROMPT_TOKENS = 128


def held_out_prompts(model_dir: Path, count: int, seed: int) -> list[list[int]]:
    """Prompts cut at random places from the held-out stdlib files (not trained on)."""
    import numpy as np
    from tokenizers import Tokenizer

    from tools.lm_data import read_texts, split_files, token_stream
    from tools.tokenizer_training import stdlib_files

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stream = token_stream(tokenizer, read_texts(split_files(stdlib_files()).heldout))
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - PROMPT_TOKENS, count)
    return [stream[s:s + PROMPT_TOKENS].tolist() for s in starts]


def make_engine(model_dir: Path, head: Path | None, k: int, batches: list[int],
                dtype: str) -> Any:
    from esurge import CacheConfig, Config, SchedulerConfig, SpeculativeConfig, eSurge

    spec = SpeculativeConfig(k, str(head)) if head is not None else None
    config = Config(
        SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=512,
                        max_model_len=PROMPT_TOKENS + NEW_TOKENS + 8,
                        chunked_prefill_enabled=True, max_num_seq_buckets=tuple(batches)),
        CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=False),
        spec,
    )
    began = time.perf_counter()
    llm = eSurge(model_dir, config, show_progress=False, dtype=dtype)
    print(f"{'eagle' if head else 'plain'} engine ready (warm-up {time.perf_counter() - began:.0f}"
          "s)", file=sys.stderr, flush=True)
    return llm


def timed_generate(llm: Any, prompts: list[list[int]]) -> float:
    from esurge import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != NEW_TOKENS for o in outs):
        raise RuntimeError("a request stopped early")
    return seconds


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    """Measure every batch size; returns one row per batch size."""
    batches = [int(b) for b in args.batches.split(",")]
    plain = make_engine(args.model, None, args.k, batches, args.dtype)
    eagle = make_engine(args.model, args.head, args.k, batches, args.dtype)
    rows = []
    try:
        pool = held_out_prompts(args.model, max(batches) * (2 * args.repeats + 1) * 2, args.seed)
        cursor = 0
        for batch in batches:
            for llm in (plain, eagle):  # untimed pass: first-touch effects off the clock
                timed_generate(llm, pool[cursor:cursor + batch])
            cursor += batch
            best = {"plain": float("inf"), "eagle": float("inf")}
            eagle.runner.spec.stats.reset()
            for _ in range(args.repeats):
                for name, llm in (("plain", plain), ("eagle", eagle)):
                    prompts = pool[cursor:cursor + batch]
                    cursor += batch
                    best[name] = min(best[name], timed_generate(llm, prompts))
            stats = eagle.runner.spec_stats
            tokens = batch * NEW_TOKENS
            row = {"batch": batch, "plain_tok_s": tokens / best["plain"],
                   "eagle_tok_s": tokens / best["eagle"],
                   "speedup": best["plain"] / best["eagle"],
                   "mean_acceptance_length": stats.mean_acceptance_length}
            rows.append(row)
            print(f"batch {batch:3d}: plain {row['plain_tok_s']:8.1f} tok/s | eagle "
                  f"{row['eagle_tok_s']:8.1f} tok/s | speedup {row['speedup']:.2f}x | "
                  f"acceptance length {row['mean_acceptance_length']:.2f}", flush=True)
    finally:
        plain.shutdown()
        eagle.shutdown()
    return rows


def main() -> int:
    """Parse arguments, run, print a summary table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "tiny-stdlib")
    p.add_argument("--head", type=Path, default=REPO / "models" / "tiny-stdlib-eagle")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    args = p.parse_args()
    for path in (args.model, args.head):
        if not (path / "config.json").is_file():
            p.error(f"{path} has no config.json (train it first: tools/train_default.py, "
                    "tools/train_eagle.py)")
    rows = run(args)
    print("\n| batch | plain tok/s | Eagle tok/s | speedup | mean acceptance length |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['eagle_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['mean_acceptance_length']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
