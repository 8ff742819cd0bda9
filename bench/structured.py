"""Structured outputs (JSON schema, llguidance): throughput cost, mask time, compile time.

    .venv/bin/python bench/structured.py [--model models/tiny-stdlib] [--reps 3]
        [--mask-steps 64] [--decode-steps 1] [--smollm2] [--json PATH]

1. Throughput. Workload W1 (bench/common.py: sets of 32 prompts of 64-128
   tokens cut from the standard library's source, tokenized with the engine's
   tokenizer; the engine config of bench/throughput.py: max_num_seqs 32,
   async scheduling on, greedy) with --new-tokens (64) max_tokens per
   request, on one engine, in two modes: "plain" (all 32 unconstrained) and
   "mixed" (every other request carries the JSON schema SCHEMA, compact). A
   constraint forbids ignore_eos, so neither mode sets it: every request may
   end early (a constrained one ends where its grammar accepts). One warm-up
   set per mode, then --reps timed sets of each, alternating the order (plain
   first on even rounds), each on fresh prompts. Generated tokens are counted
   from the outputs; the medians of tokens/s and their ratio (mixed / plain)
   are printed, with the median of each round's own ratio (its two runs are
   back to back, so a shared machine's drift cancels) and the mean output
   length of each half, so the ratio can be read honestly. Every
   constrained output is replayed through a fresh matcher of its grammar
   (every token must be accepted); one that ended on a stop token must also
   be JSON that validates against SCHEMA. The
   runner's GrammarBatch.masks and .advance are timed during the mixed runs
   (their share of the wall time is printed).
2. Mask time per step at 32 constrained rows: a GrammarBatch of 32 matchers
   from the engine's compiler, row i on schema i % 20 of
   tests/structured/cases.py (compact), each fed its EXAMPLES instance token
   by token, then its stop token (a finished row starts over, re-added
   outside the timing, so its first mask is timed). Each step times
   GrammarBatch.masks(req_ids, samples, 32) and checks, outside the timing,
   that every row's next token is allowed. Median and p99 over --mask-steps
   steps (step 0, every row's first mask, is shown too).
3. Compile: the 20 schemas on a fresh GrammarCompiler, one after another
   (cold: the future's wall time and CompiledGrammar.compile_seconds), then
   again (cached: the wall time of compile(params).result(), which must be
   the same future). p50 / p99 (with 20 samples p99 is about the max). The
   compiler's construction (llguidance's tokenizer bridge) is timed too.

--smollm2 repeats 2 and 3 with the default model's tokenizer (SmolLM2,
V=49152) from the cached GGUF, through esurge.models.checkpoint.open_checkpoint
(no engine is built for it). The machine may be shared: compare ratios within
one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GGUF = Path("~/.cache/esurge/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
ROWS = 32


def _str(min_length: int, max_length: int) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


# Long enough that most outputs run to max_tokens: the shortest instance is
# about 150 characters (the tiny tokenizer's ~3.7 bytes per token: ~40 tokens).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": _str(24, 48),
        "author": _str(16, 32),
        "summary": _str(32, 64),
        "tags": {"type": "array", "items": _str(4, 16), "minItems": 4, "maxItems": 8},
    },
    "required": ["title", "author", "summary", "tags"],
    "additionalProperties": False,
}


def cpu_model() -> str:
    """The CPU's model name and core count."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} logical cores"


def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q))


def build_engine(model: str, decode_steps: int, dtype: str) -> Any:
    """The engine with W1's config (bench/throughput.py)."""
    from esurge import CacheConfig, Config, SchedulerConfig, eSurge

    config = Config(
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=256,
                        chunked_prefill_enabled=True, max_num_seq_buckets=(8, 16, 32),
                        async_scheduling=True),
        CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=True),
    )
    local = REPO / model
    path = str(local) if not Path(model).exists() and local.exists() else model
    return eSurge(path, config, dtype=dtype, show_progress=False, decode_steps=decode_steps)


def w1_sets(engine: Any, num_sets: int) -> list[list[list[int]]]:
    """W1's prompt sets, cut with the engine's own tokenizer."""
    from bench.common import workload_w1

    with tempfile.TemporaryDirectory() as tmp:
        engine.tokenizer.save(str(Path(tmp) / "tokenizer.json"))
        return workload_w1(Path(tmp), num_sets=num_sets)


class HostProbe:
    """Times GrammarBatch.masks and .advance of a runner (instance attributes
    shadow the methods; the runner looks them up on each call)."""

    def __init__(self, batch: Any) -> None:
        self.masks: list[float] = []
        self.advance: list[float] = []
        self._batch = batch
        self._orig = (batch.masks, batch.advance)
        batch.masks = self._wrap(self._orig[0], self.masks)
        batch.advance = self._wrap(self._orig[1], self.advance)

    @staticmethod
    def _wrap(fn: Any, sink: list[float]) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append(time.perf_counter() - start)
        return timed

    def take(self) -> tuple[list[float], list[float]]:
        out = (self.masks[:], self.advance[:])
        self.masks.clear()
        self.advance.clear()
        return out

    def remove(self) -> None:
        del self._batch.masks, self._batch.advance


def check_constrained(engine: Any, outputs: list[Any]) -> dict[str, int]:
    """Replay each constrained output through a fresh matcher; validate the finished ones."""
    from tests.structured.cases import validates_json

    compiled = engine.grammars.compile(constraint()).result()
    stops = set(engine.model.eos_token_ids)
    counts = {"stop": 0, "length": 0, "other": 0, "refused": 0, "stop_invalid": 0}
    for out in outputs:
        sample = out.outputs[0]
        tokens = list(sample.token_ids)
        while tokens and tokens[-1] in stops:
            tokens.pop()
        matcher = compiled.new_matcher()
        if not all(matcher.consume_token(int(t)) for t in tokens) or matcher.is_error():
            counts["refused"] += 1
        reason = sample.finish_reason
        counts[reason if reason in ("stop", "length") else "other"] += 1
        if reason == "stop" and not (matcher.is_accepting()
                                     and validates_json(SCHEMA, engine.tokenizer.decode(tokens))):
            counts["stop_invalid"] += 1
    return counts


def constraint() -> Any:
    from esurge import StructuredOutputsParams

    return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


def mode_params(new_tokens: int) -> dict[str, list[Any]]:
    """Per-request SamplingParams of each mode: plain, and mixed (even rows constrained)."""
    from esurge import SamplingParams

    plain = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    constrained = SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                 structured_outputs=constraint())
    return {"plain": [plain] * ROWS,
            "mixed": [constrained if i % 2 == 0 else plain for i in range(ROWS)]}


def run_throughput(engine: Any, sets: list[list[list[int]]], reps: int,
                   new_tokens: int) -> dict[str, Any]:
    """The timed plain and mixed runs (one warm-up set each first)."""
    params = mode_params(new_tokens)
    engine.generate(sets[0], params["mixed"])
    engine.generate(sets[1], params["plain"])
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "mixed": []}
    probe = HostProbe(engine.runner.grammars)
    constrained: list[Any] = []
    try:
        for r in range(reps):
            for j, mode in enumerate(("plain", "mixed") if r % 2 == 0 else ("mixed", "plain")):
                prompts = sets[2 + 2 * r + j]
                probe.take()
                start = time.perf_counter()
                outputs = engine.generate(prompts, params[mode])
                wall = time.perf_counter() - start
                masks, advance = probe.take()
                lengths = [len(o.outputs[0].token_ids) for o in outputs]
                runs[mode].append({
                    "wall_s": wall, "tokens": sum(lengths), "tok_s": sum(lengths) / wall,
                    "even_rows_mean_len": statistics.mean(lengths[0::2]),
                    "odd_rows_mean_len": statistics.mean(lengths[1::2]),
                    "mask_calls": len(masks), "mask_s": sum(masks),
                    "mask_ms_p50": pct(masks, 50) * 1e3 if masks else 0.0,
                    "mask_ms_p99": pct(masks, 99) * 1e3 if masks else 0.0,
                    "advance_s": sum(advance)})
                if mode == "mixed":
                    constrained.extend(outputs[0::2])
    finally:
        probe.remove()
    plain = statistics.median(r["tok_s"] for r in runs["plain"])
    mixed = statistics.median(r["tok_s"] for r in runs["mixed"])
    # The two runs of a round are back to back: their ratio cancels the drift
    # of a shared machine that the medians over all rounds keep.
    paired = statistics.median(m["tok_s"] / p["tok_s"]
                               for p, m in zip(runs["plain"], runs["mixed"], strict=True))
    return {"runs": runs, "plain_tok_s": plain, "mixed_tok_s": mixed, "ratio": mixed / plain,
            "paired_ratio": paired,
            "constrained_check": check_constrained(engine, constrained),
            "constrained_lengths": [len(o.outputs[0].token_ids) for o in constrained]}


def schema_params() -> list[tuple[str, Any, str]]:
    """(name, compact constraint, instance) for the 20 schemas of the test corpus."""
    from esurge import StructuredOutputsParams
    from tests.structured.cases import EXAMPLES, JSON_SCHEMAS

    return [(name, StructuredOutputsParams(json=schema, disable_any_whitespace=True),
             EXAMPLES[name]) for name, schema in JSON_SCHEMAS.items()]


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def mask_bench(compiler: Any, tokenizer: Any, stop_id: int, steps: int) -> dict[str, Any]:
    """Per-step GrammarBatch.masks at ROWS constrained rows (see the module docstring)."""
    from esurge.structured_output.batch import GrammarBatch

    cases = schema_params()
    grammars = [compiler.compile(p).result() for _, p, _ in cases]
    streams = [[*tokenizer.encode(text, add_special_tokens=False).ids, stop_id]
               for _, _, text in cases]
    batch = GrammarBatch(compiler.vocab_size)
    req_ids = [f"row{i}" for i in range(ROWS)]
    which = [i % len(cases) for i in range(ROWS)]
    pos = [0] * ROWS
    for i, rid in enumerate(req_ids):
        batch.add(rid, grammars[which[i]], (stop_id,), [])
    samples = np.ones(ROWS, bool)
    times: list[float] = []
    refused = 0
    for _ in range(steps):
        start = time.perf_counter()
        masks = batch.masks(req_ids, samples, ROWS)
        times.append(time.perf_counter() - start)
        for i, rid in enumerate(req_ids):
            stream = streams[which[i]]
            token = stream[pos[i]]
            refused += not _allowed(masks[i], token)
            batch.advance(rid, pos[i], [token])
            pos[i] += 1
            if pos[i] == len(stream):  # the instance ended: start the row over
                batch.remove([rid])
                batch.add(rid, grammars[which[i]], (stop_id,), [])
                pos[i] = 0
    return {"vocab": compiler.vocab_size, "words": batch.words, "steps": steps,
            "first_ms": times[0] * 1e3, "p50_ms": pct(times, 50) * 1e3,
            "p99_ms": pct(times, 99) * 1e3, "max_ms": max(times) * 1e3,
            "mean_instance_tokens": statistics.mean(len(s) for s in streams),
            "refused_tokens": refused}


def compile_bench(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> dict[str, Any]:
    """Cold and cached compile of the 20 schemas on a fresh GrammarCompiler."""
    from esurge.structured_output.compiler import GrammarCompiler

    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
    bridge = time.perf_counter() - start
    cases = schema_params()
    cold_wall, cold_build, cached, futures = [], [], [], []
    try:
        for _, params, _ in cases:
            start = time.perf_counter()
            future = compiler.compile(params)
            compiled = future.result()
            cold_wall.append(time.perf_counter() - start)
            cold_build.append(compiled.compile_seconds)
            futures.append(future)
        for (_, params, _), first in zip(cases, futures, strict=True):
            start = time.perf_counter()
            future = compiler.compile(params)
            future.result()
            cached.append(time.perf_counter() - start)
            if future is not first:
                raise RuntimeError("a cached compile returned a different future")
    finally:
        compiler.shutdown()
    ms = 1e3
    return {"schemas": len(cases), "bridge_ms": bridge * ms,
            "cold_wall_ms_p50": pct(cold_wall, 50) * ms,
            "cold_wall_ms_p99": pct(cold_wall, 99) * ms,
            "cold_build_ms_p50": pct(cold_build, 50) * ms,
            "cold_build_ms_p99": pct(cold_build, 99) * ms,
            "cached_us_p50": pct(cached, 50) * 1e6, "cached_us_p99": pct(cached, 99) * 1e6,
            "hits": compiler.num_cache_hits, "compiles": compiler.num_compiles}


def smollm2_pieces(steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Mask and compile benches with SmolLM2's tokenizer from the cached GGUF."""
    from esurge.models.checkpoint import open_checkpoint
    from esurge.structured_output.compiler import GrammarCompiler

    hf = open_checkpoint(GGUF.expanduser()).tokenizer()
    backend, eos = hf.backend_tokenizer, int(hf.eos_token_id)
    vocab = 49152
    compiler = GrammarCompiler(backend, vocab, [eos])
    try:
        masks = mask_bench(compiler, backend, eos, steps)
    finally:
        compiler.shutdown()
    return masks, compile_bench(backend, vocab, [eos])


def print_throughput(t: dict[str, Any], new_tokens: int) -> None:
    print(f"1. W1 throughput, {ROWS} requests, max_tokens {new_tokens}, greedy, async "
          f"scheduling; mixed = every other request constrained to SCHEMA")
    print(f"   {'mode':5} {'tok/s runs':>28} {'median':>8} {'mean len even/odd rows':>24} "
          f"{'masks s (calls, p50/p99 ms)':>30} {'advance s':>9}")
    for mode in ("plain", "mixed"):
        runs = t["runs"][mode]
        rates = ", ".join(f"{r['tok_s']:.0f}" for r in runs)
        lens = "/".join(f"{statistics.mean(r[k] for r in runs):.1f}"
                        for k in ("even_rows_mean_len", "odd_rows_mean_len"))
        mask = (f"{statistics.mean(r['mask_s'] for r in runs):.3f} "
                f"({statistics.mean(r['mask_calls'] for r in runs):.0f}, "
                f"{statistics.median(r['mask_ms_p50'] for r in runs):.2f}/"
                f"{max(r['mask_ms_p99'] for r in runs):.2f})")
        adv = statistics.mean(r["advance_s"] for r in runs)
        median = t[f"{mode}_tok_s"]
        print(f"   {mode:5} {rates:>28} {median:>8.0f} {lens:>24} {mask:>30} {adv:>9.3f}")
    mixed = t["runs"]["mixed"]
    share = statistics.mean((r["mask_s"] + r["advance_s"]) / r["wall_s"] for r in mixed)
    lengths = t["constrained_lengths"]
    print(f"   ratio mixed/plain: {t['ratio']:.3f} of the medians, {t['paired_ratio']:.3f} median "
          f"of the rounds' own (goal >= 0.9); masks+advance = {share:.1%} "
          f"of the mixed runs' wall time")
    check = t["constrained_check"]
    print(f"   constrained outputs (the even rows of mixed): {len(lengths)}, length min/mean/max "
          f"{min(lengths)}/{statistics.mean(lengths):.1f}/{max(lengths)}; {json.dumps(check)}")
    if not check["stop"]:
        print("   (none ended on a stop token: no complete JSON was validated, only that every "
              "token was accepted; a larger --new-tokens lets them finish)")


def print_micro(label: str, masks: dict[str, Any], comp: dict[str, Any]) -> None:
    print(f"   {label:<22} V={masks['vocab']:<6} step p50 {masks['p50_ms']:7.3f} ms  "
          f"p99 {masks['p99_ms']:7.3f} ms  first {masks['first_ms']:7.3f} ms  "
          f"({masks['steps']} steps, refused {masks['refused_tokens']})")
    print(f"   {'':<22} compile cold p50 {comp['cold_wall_ms_p50']:7.2f} ms  "
          f"p99 {comp['cold_wall_ms_p99']:7.2f} ms (build p50 {comp['cold_build_ms_p50']:.2f} "
          f"p99 {comp['cold_build_ms_p99']:.2f})  cached p50 {comp['cached_us_p50']:.1f} us  "
          f"p99 {comp['cached_us_p99']:.1f} us  bridge {comp['bridge_ms']:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-stdlib")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--reps", type=int, default=3, help="timed sets of each mode")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=1)
    parser.add_argument("--mask-steps", type=int, default=64)
    parser.add_argument("--smollm2", action="store_true",
                        help="also measure masks and compiles with SmolLM2's tokenizer")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    engine = build_engine(args.model, args.decode_steps, args.dtype)
    try:
        print(f"model {args.model} ({engine.model.dtype}, V={engine.model.vocab_size}), "
              f"warm-up {engine.warmup_seconds:.1f}s, decode_steps {args.decode_steps}")
        sets = w1_sets(engine, 2 + 2 * args.reps)
        result: dict[str, Any] = {"cpu": cpu_model(), "model": args.model,
                                  "throughput": run_throughput(engine, sets, args.reps,
                                                               args.new_tokens)}
        print_throughput(result["throughput"], args.new_tokens)
        compiler = engine.grammars.compiler
        stop = int(engine.model.eos_token_ids[0])
        micro = {"engine": (mask_bench(compiler, engine.tokenizer, stop, args.mask_steps),
                            compile_bench(engine.tokenizer, engine.model.vocab_size,
                                          engine.model.eos_token_ids))}
    finally:
        engine.shutdown()
    if args.smollm2:
        micro["smollm2"] = smollm2_pieces(args.mask_steps)
    print(f"2./3. masks at {ROWS} constrained rows (GrammarBatch.masks), compiles of 20 schemas")
    for label, (masks, comp) in micro.items():
        print_micro(label, masks, comp)
    result["micro"] = {k: {"masks": m, "compile": c} for k, (m, c) in micro.items()}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
