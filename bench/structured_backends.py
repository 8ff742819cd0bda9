"""Grammar-constrained decoding backends, llguidance against xgrammar, on this machine's CPU.

    .venv/bin/python bench/structured_backends.py [--quick] [--steps 30] [--json PATH]

For each backend and each of two tokenizers it measures:

1. the tokenizer bridge: llguidance.hf.from_tokenizer / xgrammar.TokenizerInfo.from_huggingface;
2. cold compile of the 20 JSON schemas of tests/structured/cases.py (nested
   objects, arrays with minItems/maxItems, enums, integer/number bounds, string
   patterns and formats, required/optional, $ref/$defs, anyOf), one fresh compiler per schema and no
   cache: p50 / p99 / total. llguidance's compile is building an LLMatcher from
   LLMatcher.grammar_from_json_schema; xgrammar's is GrammarCompiler.compile_json_schema
   (cache_enabled=False). Because llguidance computes masks lazily and xgrammar
   precomputes them at compile time, "first mask" adds a matcher and its first
   bitmask to the compile: the real cost before a request's first constrained token;
3. the per-step mask at 32 constrained rows: 32 matchers (row i on schema i % 20),
   each fed a valid instance of its schema token by token (the instance as the
   HF tokenizer encodes it, then EOS; a finished row starts over), timing the
   fill of one [32, ceil(V/32)] int32 bitmask for all rows per step: llguidance
   with fill_next_token_bitmask_par on an LLExecutor and row by row with
   fill_next_token_bitmask; xgrammar row by row with
   GrammarMatcher.fill_next_token_bitmask and, for a like-for-like parallel
   figure, BatchGrammarMatcher.batch_fill_next_token_bitmask. Median and p99
   over the steps (with ~30 steps p99 is about the max; step 0, each row's first
   mask, is also shown). Every step checks that the next token of each row's
   instance is allowed by its mask, outside the timing.

Tokenizers (nothing is downloaded):
  smollm2-49k  the default model's (SmolLM2-135M-Instruct, V=49152), from the cached GGUF
               through esurge.models.checkpoint.open_checkpoint;
  synth-262k   a synthetic V=262144 byte-level BPE (the size of Gemma 3's vocabulary):
               SmolLM2's tokenizer.json with its vocabulary and merges extended
               programmatically (see extended_tokenizer): whitespace runs, single
               characters of eight scripts (Latin, Greek, Cyrillic, Arabic, Devanagari,
               kana, CJK, Hangul) built from their UTF-8 bytes, then CJK bigrams and
               English compound words, each new token a merge of two existing ones.

xgrammar is optional (it is not a project dependency): when it cannot be imported,
llguidance alone is measured. Install it for a comparison with
`pip install --no-deps xgrammar apache-tvm-ffi` (it imports without triton, which it
needs only for GPU kernels). The machine may be shared: compare ratios, not absolute
numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.backend_tokenizers import BIG_VOCAB, extended_tokenizer, smollm2_tokenizer  # noqa: E402

ROWS = 32

Schema = dict[str, Any]

def _corpus() -> list[tuple[str, Schema, Any]]:
    """(name, schema, a valid instance) of the test corpus's 20 schemas
    (tests/structured/cases.py); instances list properties in schema order,
    which both backends keep by default."""
    from tests.structured.cases import EXAMPLES, JSON_SCHEMAS

    return [(name, schema, json.loads(EXAMPLES[name])) for name, schema in JSON_SCHEMAS.items()]


SCHEMAS = _corpus()


# ---------------------------------------------------------------- backends


@dataclass
class MaskVariant:
    """One way of filling the [rows, words] bitmask for all rows."""

    name: str
    fill: Callable[[list[Any], np.ndarray], None]


class LLGuidance:
    """llguidance: LLMatcher per row, masks computed on demand."""

    name = "llguidance"

    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.lib, self.hf, self.np = llguidance, llguidance.hf, llguidance.numpy
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.tokenizer: Any = None

    def bridge(self, hf_tokenizer: Any, vocab: int) -> None:
        self.tokenizer = self.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)

    def _matcher(self, grammar: str) -> Any:
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")
        return matcher

    def compile(self, schema: Schema) -> tuple[Any, Any]:
        """(what rows are made from, a matcher ready for its first mask)."""
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        return grammar, self._matcher(grammar)

    def first_mask(self, matcher: Any, mask: np.ndarray) -> None:
        self.np.fill_next_token_bitmask(matcher, mask, 0)

    def new_row(self, compiled: Any) -> Any:
        return self._matcher(compiled)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def variants(self) -> list[MaskVariant]:
        def parallel(rows: list[Any], mask: np.ndarray) -> None:
            self.np.fill_next_token_bitmask_par(
                self.executor, [(m, i) for i, m in enumerate(rows)], mask)

        def sequential(rows: list[Any], mask: np.ndarray) -> None:
            for i, m in enumerate(rows):
                self.np.fill_next_token_bitmask(m, mask, i)

        return [MaskVariant("par (LLExecutor)", parallel), MaskVariant("per row", sequential)]


class XGrammar:
    """xgrammar: GrammarCompiler (adaptive token-mask cache built at compile) + GrammarMatcher."""

    name = "xgrammar"

    def __init__(self, threads: int) -> None:
        import xgrammar

        self.lib, self.threads = xgrammar, threads
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.info: Any = None

    def bridge(self, hf_tokenizer: Any, vocab: int) -> None:
        self.info = self.lib.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)

    def compile(self, schema: Schema) -> tuple[Any, Any]:
        compiler = self.lib.GrammarCompiler(self.info, max_threads=self.threads,
                                            cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema))
        return compiled, compiled

    def first_mask(self, compiled: Any, mask: np.ndarray) -> None:
        self.lib.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)

    def new_row(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def finished(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())

    def reset(self, matcher: Any) -> None:
        matcher.reset()

    def variants(self) -> list[MaskVariant]:
        def sequential(rows: list[Any], mask: np.ndarray) -> None:
            for i, m in enumerate(rows):
                m.fill_next_token_bitmask(mask, i)

        def batched(rows: list[Any], mask: np.ndarray) -> None:
            self.batch.batch_fill_next_token_bitmask(rows, mask)

        return [MaskVariant("per row", sequential), MaskVariant("batch (BatchGrammarMatcher)",
                                                                batched)]


Backend = LLGuidance | XGrammar


# ---------------------------------------------------------------- measurements


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / total of `seconds`, in milliseconds."""
    ms = np.asarray(seconds) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "total": float(ms.sum())}


def measure_compile(backend: Backend, vocab: int) -> tuple[list[Any], dict[str, Any]]:
    """Cold compile of every schema, then its first mask; (compiled per schema, stats)."""
    mask = np.zeros((1, math.ceil(vocab / 32)), dtype=np.int32)
    compiled, compile_s, first_s = [], [], []
    for _, schema, _ in SCHEMAS:
        start = time.perf_counter()
        rows_from, ready = backend.compile(schema)
        compiled_at = time.perf_counter()
        backend.first_mask(ready, mask)
        done = time.perf_counter()
        compiled.append(rows_from)
        compile_s.append(compiled_at - start)
        first_s.append(done - start)
    return compiled, {"compile_ms": percentiles_ms(compile_s),
                      "compile_and_first_mask_ms": percentiles_ms(first_s)}


def allowed(mask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)


def measure_variant(backend: Backend, variant: MaskVariant, compiled: list[Any],
                    sequences: list[list[int]], vocab: int, steps: int) -> dict[str, float]:
    """Per-step time of variant.fill over ROWS fresh matchers walked along their instances."""
    rows = [backend.new_row(compiled[i % len(compiled)]) for i in range(ROWS)]
    seqs = [sequences[i % len(sequences)] for i in range(ROWS)]
    pos = [0] * ROWS
    mask = np.zeros((ROWS, math.ceil(vocab / 32)), dtype=np.int32)
    times, rejected = [], 0
    for _ in range(steps):
        mask.fill(0)
        start = time.perf_counter()
        variant.fill(rows, mask)
        times.append(time.perf_counter() - start)
        for i, matcher in enumerate(rows):
            token = seqs[i][pos[i]]
            rejected += not allowed(mask, i, token)
            if not backend.consume(matcher, token):
                raise RuntimeError(f"{backend.name} rejected token {token} of row {i}")
            pos[i] += 1
            if pos[i] == len(seqs[i]):
                if not backend.finished(matcher):
                    raise RuntimeError(f"{backend.name}: row {i} not finished after EOS")
                backend.reset(matcher)
                pos[i] = 0
    ms = np.asarray(times) * 1e3
    return {"median": float(np.median(ms)), "p99": float(np.percentile(ms, 99)),
            "step0": float(ms[0]), "masked_out_next_tokens": rejected}


def instance_tokens(hf_tokenizer: Any) -> list[list[int]]:
    """Each schema's instance as the tokenizer encodes it, then EOS."""
    eos = hf_tokenizer.eos_token_id
    return [[*hf_tokenizer(json.dumps(instance, separators=(",", ":")),
                           add_special_tokens=False).input_ids, eos]
            for _, _, instance in SCHEMAS]


def measure_backend(backend: Backend, hf_tokenizer: Any, vocab: int, steps: int
                    ) -> dict[str, Any]:
    """Bridge, compile and mask figures of one backend on one tokenizer."""
    start = time.perf_counter()
    backend.bridge(hf_tokenizer, vocab)
    result: dict[str, Any] = {"bridge_s": time.perf_counter() - start}
    compiled, result_compile = measure_compile(backend, vocab)
    result.update(result_compile)
    sequences = instance_tokens(hf_tokenizer)
    result["mask_ms"] = {v.name: measure_variant(backend, v, compiled, sequences, vocab, steps)
                         for v in backend.variants()}
    return result


# ---------------------------------------------------------------- reporting


def cpu_model() -> str:
    """The first CPU's model name in /proc/cpuinfo, with its family and model numbers."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        import platform

        return platform.processor() or "unknown"
    return (f"{fields['model name']} (family {fields.get('cpu family', '?')}, "
            f"model {fields.get('model', '?')})")


def version_of(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def print_tables(report: dict[str, Any]) -> None:
    """The report as two fixed-width tables."""
    print(f"\nCPU: {report['cpu']} ({report['cpus']} logical CPUs; {report['threads']} "
          f"threads for the parallel fills) | {ROWS} rows, {report['steps']} steps, "
          f"{len(SCHEMAS)} schemas")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()))
    print("\nbridge and cold compile (ms; compile+1st = compile, a matcher and its first mask)")
    head = (f"{'tokenizer':<12} {'backend':<11} {'bridge':>8} {'cmp p50':>8} {'cmp p99':>8} "
            f"{'cmp tot':>8} {'+1st p50':>8} {'+1st p99':>8} {'+1st tot':>8}")
    print(head + "\n" + "-" * len(head))
    for tok_name, tok in report["tokenizers"].items():
        for name, r in tok["backends"].items():
            c, f = r["compile_ms"], r["compile_and_first_mask_ms"]
            print(f"{tok_name:<12} {name:<11} {r['bridge_s'] * 1e3:8.0f} {c['p50']:8.2f} "
                  f"{c['p99']:8.2f} {c['total']:8.1f} {f['p50']:8.2f} {f['p99']:8.2f} "
                  f"{f['total']:8.1f}")
    print(f"\nmask for all {ROWS} rows per step (ms); bad = next instance tokens the mask "
          "refused (must be 0)")
    for tok_name, tok in report["tokenizers"].items():
        print(f"  {tok_name}: V={tok['vocab']}, instances {tok['instance_tokens_mean']:.1f} "
              "tokens on average (with EOS)")
    head = (f"{'tokenizer':<12} {'backend':<11} {'fill':<28} {'median':>8} {'p99':>8} "
            f"{'step 0':>8} {'us/row':>7} {'bad':>4}")
    print(head + "\n" + "-" * len(head))
    for tok_name, tok in report["tokenizers"].items():
        for name, r in tok["backends"].items():
            for variant, m in r["mask_ms"].items():
                print(f"{tok_name:<12} {name:<11} {variant:<28} {m['median']:8.3f} "
                      f"{m['p99']:8.3f} {m['step0']:8.3f} {m['median'] * 1e3 / ROWS:7.1f} "
                      f"{m['masked_out_next_tokens']:4d}")


# ---------------------------------------------------------------- main


def backend_types() -> list[type[Backend]]:
    """llguidance, and xgrammar when it can be imported."""
    found: list[type[Backend]] = [LLGuidance]
    try:
        import xgrammar  # noqa: F401
    except Exception as error:  # ImportError, or a missing dependency of its own
        print(f"xgrammar cannot be imported ({type(error).__name__}: {error}); "
              "measuring llguidance only", flush=True)
    else:
        found.append(XGrammar)
    return found


def run(steps: int, threads: int) -> dict[str, Any]:
    """Every backend on both tokenizers."""
    types = backend_types()
    base = smollm2_tokenizer()
    start = time.perf_counter()
    big = extended_tokenizer(base)
    print(f"built the synthetic {BIG_VOCAB}-token tokenizer in "
          f"{time.perf_counter() - start:.1f}s", flush=True)
    report: dict[str, Any] = {
        "cpu": cpu_model(), "cpus": os.cpu_count(), "threads": threads, "steps": steps,
        "versions": {p: v for p in ("llguidance", "xgrammar", "tokenizers", "transformers")
                     if (v := version_of(p)) is not None},
        "tokenizers": {}}
    for tok_name, hf, vocab in (("smollm2-49k", base, len(base)), ("synth-262k", big, BIG_VOCAB)):
        lengths = [len(seq) for seq in instance_tokens(hf)]
        entry: dict[str, Any] = {"vocab": vocab, "instance_tokens_mean": float(np.mean(lengths)),
                                 "backends": {}}
        for backend in (kind(threads) for kind in types):
            print(f"measuring {backend.name} on {tok_name} (V={vocab})", flush=True)
            entry["backends"][backend.name] = measure_backend(backend, hf, vocab, steps)
        report["tokenizers"][tok_name] = entry
    return report


def main() -> int:
    """Parse arguments, measure, print the tables (and write the JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="decode steps per mask figure")
    p.add_argument("--quick", action="store_true", help="10 steps instead of --steps")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads of LLExecutor, BatchGrammarMatcher and GrammarCompiler")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    report = run(10 if args.quick else args.steps, args.threads)
    print_tables(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
