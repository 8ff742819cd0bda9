"""Eagle speculative decoding: generated tokens/s with and without it, same run.

The default model (models/tiny-stdlib) with and without its Eagle head
(models/tiny-stdlib-eagle), greedy, ignore_eos, in --dtype (default
float32; auto would serve the bfloat16 checkpoint natively where the CPU has
AVX512_BF16): batches of 1, 4 and 16
prompts of 128 tokens cut from held-out standard-library files, 128 new
tokens each. Both engines are warmed up fully (no compile while timed) and
the prefix cache is off, so every timed set does its whole prefill. Each
engine runs in a process of its own, the two in turn --rounds times; per
batch size an untimed pass, then --repeats timed ones on fresh prompts; the
best time of each engine is reported (the machine may be shared), and each
round's speedup (the two engines back to back) as a median and range, with the
Eagle engine's mean acceptance length and drafts per verification (the
adaptive policy chooses each step's count, 1 to k) over its timed runs.

    .venv/bin/python bench/spec_decode.py [--k 4] [--repeats 2] [--batches 1,4,16]
        [--buckets 4,16]
        [--dtype float32] [--speculation adaptive] [--prompts stdlib|random|chat]
        [--rounds 2] [--scheduling async|sync] [--model M --head H] [--paired [--control]]

--paired runs both engines in one process instead: each timed set by one
engine then the other on the same prompts (the first alternating), medians
of --repeats pairs. Two processes of the same engine differ by a few percent
on a CPU, more than the differences a 0.97x criterion needs; pairs in one
process do not carry that.
--control (with --paired) builds a second plain engine in the Eagle one's
place: the same table then shows what the pairing measures between two
identical engines (their order of creation included), the floor under any
ratio it reports.

The default model with its head: --model smollm2-135m-instruct
--head models/smollm2-eagle --prompts chat. Each batch size takes the next
prompts of one seeded order, so batch 1 always times its first --repeats
chats: with 6 they are easy ones (3.3-4.0 tokens a verification against a
held-out mean of 2.2-2.4); --batches 1 --repeats 16 or more stands for the
held-out chats (README: "These batch-1 figures are six easy chats").

Both engines schedule asynchronously by default (as eSurge(model_dir) does):
the Eagle engine's plain steps overlap, and so do its steady speculative
ones (they hand their drafts to the next step at dispatch); any other
speculative one is read back before the next is scheduled, which then runs
while the loop processes the outputs.
--speculation adaptive (the engine's default) lets each request of the Eagle
engine try drafting where the measured step costs say a request whose drafts
are mostly accepted would gain, and stops the drafts of each one whose own
acceptance says they do not pay (esurge/spec_decode/request_gate.py); always
drafts on every step. bench/spec_policies.py compares the policies in one
engine over many more prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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


def random_prompts(model_dir: Path, count: int, seed: int) -> list[list[int]]:
    """Prompts of uniformly random token ids: text no model predicts, so the
    head's drafts are rarely accepted (the case speculation must not lose)."""
    import numpy as np

    from esurge.models.checkpoint import open_checkpoint

    vocab = open_checkpoint(model_dir).hf_config().vocab_size  # a GGUF has no config.json
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(count, PROMPT_TOKENS)).tolist()


def chat_prompts(model_dir: Path, count: int, seed: int) -> list[Any]:
    """Chat prompts about topics no head was trained on (tools/chat_prompts.py),
    rendered by the model's chat template, in a seeded order."""
    import numpy as np

    from esurge.engine.chat import ChatMessage, ChatPrompt
    from tools.chat_prompts import chat_prompts as held_out

    texts = held_out("heldout")
    order = np.random.default_rng(seed).permutation(len(texts))
    return [ChatPrompt((ChatMessage("user", texts[order[i % len(texts)]]),))
            for i in range(count)]


def request_buckets(args: argparse.Namespace) -> list[int]:
    """The engine's request buckets: --buckets, or one per batch size."""
    batches = [int(b) for b in args.batches.split(",")]
    if not args.buckets:
        return batches
    buckets = sorted(int(b) for b in args.buckets.split(","))
    if buckets[-1] < max(batches):
        raise SystemExit(f"--buckets {args.buckets} must reach the largest batch {max(batches)}")
    return buckets


def make_engine(model_dir: Path, head: Path | None, k: int, buckets: list[int],
                dtype: str, speculation: str, async_scheduling: bool) -> Any:
    from esurge import CacheConfig, Config, SchedulerConfig, SpeculativeConfig, eSurge

    spec = SpeculativeConfig(k, str(head)) if head is not None else None
    config = Config(
        SchedulerConfig(max_num_seqs=max(buckets), max_num_batched_tokens=512,
                        max_model_len=PROMPT_TOKENS + NEW_TOKENS + 8,
                        chunked_prefill_enabled=True, max_num_seq_buckets=tuple(buckets),
                        async_scheduling=async_scheduling),
        CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=False),
        spec,
    )
    began = time.perf_counter()
    llm = eSurge(model_dir, config, show_progress=False, dtype=dtype, speculation=speculation)
    print(f"{'eagle' if head else 'plain'} engine ready (warm-up {time.perf_counter() - began:.0f}"
          "s)", file=sys.stderr, flush=True)
    return llm


def timed_generate(llm: Any, prompts: list[Any]) -> float:
    from esurge import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != NEW_TOKENS for o in outs):
        raise RuntimeError("a request stopped early")
    return seconds


def prompt_pool(args: argparse.Namespace, batches: list[int]) -> list[Any]:
    """Enough prompts of --prompts' kind for every batch size's passes."""
    make = {"stdlib": held_out_prompts, "random": random_prompts,
            "chat": chat_prompts}[args.prompts]
    return make(args.model, max(batches) * (args.repeats + 1) * len(batches), args.seed)


def spec_row(llm: Any, batch: int) -> dict[str, float]:
    """The Eagle engine's acceptance and drafts per verification since its stats'
    last reset; prints the policy's measured rates."""
    stats = llm.runner.spec_stats
    rates = getattr(llm.runner.spec.policy, "rates", {})
    measured = {f"{'spec' if s else 'plain'}@{b}": round(r.tokens_per_s)
                for (s, b), r in sorted(rates.items(), key=lambda kv: kv[0][1])}
    print(f"  batch {batch}: policy rates (tok/s by mode@batch) {measured}", file=sys.stderr)
    return {"acceptance": stats.mean_acceptance_length,
            "drafts": (stats.num_draft_tokens / stats.num_verifications
                       if stats.num_verifications else 0.0)}


def measure_paired(args: argparse.Namespace) -> list[dict[str, float]]:
    """Both engines in this process, each timed set run by one then the other on
    the same prompts (the first alternating), --repeats pairs per batch size;
    per batch size the median seconds of each and the per-pair speedups. Two
    processes of one engine differ by a few percent on a CPU; one process's
    pairs do not carry that, so this resolves differences of a few percent."""
    batches = [int(b) for b in args.batches.split(",")]
    asynchronous = args.scheduling == "async"
    second = None if args.control else args.head
    engines = [make_engine(args.model, head, args.k, request_buckets(args), args.dtype,
                           args.speculation, asynchronous) for head in (None, second)]
    rows = []
    try:
        pool, cursor = prompt_pool(args, batches), 0
        for batch in batches:
            for llm in engines:  # first-touch effects off the clock
                timed_generate(llm, pool[cursor:cursor + batch])
            cursor += batch
            if not args.control:
                engines[1].runner.spec.stats.reset()
            times: list[list[float]] = [[], []]
            for repeat in range(args.repeats):
                prompts = pool[cursor:cursor + batch]
                cursor += batch
                for which in ((0, 1) if repeat % 2 == 0 else (1, 0)):
                    times[which].append(timed_generate(engines[which], prompts))
            speedups = [p / e for p, e in zip(*times, strict=True)]
            plain, eagle = statistics.median(times[0]), statistics.median(times[1])
            spec = ({"acceptance": 0.0, "drafts": 0.0} if args.control
                    else spec_row(engines[1], batch))
            rows.append({"batch": batch, "plain_tok_s": batch * NEW_TOKENS / plain,
                         "eagle_tok_s": batch * NEW_TOKENS / eagle, "speedup": plain / eagle,
                         "paired_median": statistics.median(speedups),
                         "paired_low": min(speedups), "paired_high": max(speedups),
                         "mean_acceptance_length": spec["acceptance"],
                         "drafts_per_verification": spec["drafts"]})
    finally:
        for llm in engines:
            llm.shutdown()
    return rows


def measure(args: argparse.Namespace, eagle: bool) -> dict[int, dict[str, float]]:
    """One engine's best seconds per batch size (and the Eagle one's acceptance),
    in this process. Per batch size: an untimed pass, then --repeats timed ones."""
    batches = [int(b) for b in args.batches.split(",")]
    llm = make_engine(args.model, args.head if eagle else None, args.k, request_buckets(args),
                      args.dtype, args.speculation, args.scheduling == "async")
    out: dict[int, dict[str, float]] = {}
    try:
        pool = prompt_pool(args, batches)
        cursor = 0
        for batch in batches:
            timed_generate(llm, pool[cursor:cursor + batch])  # first-touch effects off the clock
            cursor += batch
            if eagle:
                llm.runner.spec.stats.reset()
            best = float("inf")
            for _ in range(args.repeats):
                best = min(best, timed_generate(llm, pool[cursor:cursor + batch]))
                cursor += batch
            row = {"seconds": best, **(spec_row(llm, batch) if eagle else {})}
            out[batch] = row
    finally:
        llm.shutdown()
    return out


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    """Each engine in a process of its own (neither inherits the other's caches,
    threads or memory), --rounds times in turn. Returns one row per batch size:
    the best time of each engine, and the speedup of each round (the plain
    engine's time over the Eagle one's, the two run back to back) as its median
    and range: two processes of one engine differ by a few percent, so one
    round's ratio is no measurement of a few percent."""
    best: dict[str, dict[int, dict[str, float]]] = {}
    ratios: dict[int, list[float]] = {}
    for _ in range(args.rounds):
        this_round: dict[str, dict[int, dict[str, float]]] = {}
        for name in ("plain", "eagle"):
            child = [sys.executable, __file__, "--child", name, "--model", str(args.model),
                     "--head", str(args.head), "--k", str(args.k), "--repeats",
                     str(args.repeats), "--batches", args.batches, "--seed", str(args.seed),
                     "--buckets", args.buckets,
                     "--dtype", args.dtype, "--speculation", args.speculation,
                     "--prompts", args.prompts, "--scheduling", args.scheduling]
            done = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True)
            result = {int(b): r for b, r in json.loads(done.stdout.splitlines()[-1]).items()}
            this_round[name] = result
            for batch, row in result.items():
                kept = best.setdefault(name, {}).get(batch)
                if kept is None or row["seconds"] < kept["seconds"]:
                    best[name][batch] = row
        for batch, row in this_round["eagle"].items():
            ratios.setdefault(batch, []).append(
                this_round["plain"][batch]["seconds"] / row["seconds"])
    rows = []
    for batch in sorted(best["plain"]):
        plain, eagle = best["plain"][batch], best["eagle"][batch]
        tokens = batch * NEW_TOKENS
        rows.append({"batch": batch, "plain_tok_s": tokens / plain["seconds"],
                     "eagle_tok_s": tokens / eagle["seconds"],
                     "speedup": plain["seconds"] / eagle["seconds"],
                     "paired_median": statistics.median(ratios[batch]),
                     "paired_low": min(ratios[batch]), "paired_high": max(ratios[batch]),
                     "mean_acceptance_length": eagle["acceptance"],
                     "drafts_per_verification": eagle["drafts"]})
    return rows


def main() -> int:
    """Parse arguments, run, print a summary table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "models" / "tiny-stdlib")
    p.add_argument("--head", type=Path, default=REPO / "models" / "tiny-stdlib-eagle")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--buckets", default="",
                   help="request buckets (default: one per batch size); make serve's: 4,16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--speculation", default="adaptive", choices=("adaptive", "always"))
    p.add_argument("--scheduling", default="async", choices=("async", "sync"),
                   help="both engines' scheduling (async: the engine's default)")
    p.add_argument("--rounds", type=int, default=2, help="engine processes per engine, in turn")
    p.add_argument("--prompts", default="stdlib", choices=("stdlib", "random", "chat"),
                   help="held-out stdlib code (drafts often accepted), random token ids "
                        "(rarely), or chat prompts on held-out topics (a chat model's head)")
    p.add_argument("--control", action="store_true",
                   help="with --paired: a second plain engine in the Eagle one's place, "
                        "so the table shows what pairing itself measures")
    p.add_argument("--paired", action="store_true",
                   help="both engines in this process, each timed set run by both back to "
                        "back, --repeats pairs per batch size; medians instead of bests")
    p.add_argument("--child", choices=("plain", "eagle"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args, args.child == "eagle")))
        return 0
    from esurge.packaged import resolve_model_path

    args.model = resolve_model_path(args.model)  # a packaged model's name works too
    for path in (args.model, args.head):
        if not (path / "config.json").is_file() and path.suffix != ".gguf":
            p.error(f"{path} has no config.json (train it first: tools/train_default.py, "
                    "tools/train_eagle.py)")
    if args.control and not args.paired:
        p.error("--control needs --paired")
    rows = measure_paired(args) if args.paired else run(args)
    kept, each = (("medians", f"pair, median (range) of {args.repeats}") if args.paired
                  else ("bests", f"round, median (range) of {args.rounds}"))
    second = "second plain" if args.control else "Eagle"
    print(f"\n| batch | plain tok/s | {second} tok/s | speedup ({kept}) | speedup per {each} | "
          "mean acceptance length | drafts per verification |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['plain_tok_s']:.1f} | {r['eagle_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['paired_median']:.2f}x ({r['paired_low']:.2f}-"
              f"{r['paired_high']:.2f}) | {r['mean_acceptance_length']:.2f} | "
              f"{r['drafts_per_verification']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
