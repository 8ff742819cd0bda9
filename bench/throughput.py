"""Workload W1 throughput: eSurge vs transformers generate, same checkpoint, same run.

W1: 32 prompts of 64-128 tokens cut from the Python standard library's source,
64 new tokens each, greedy, ignore_eos, float32, all submitted at once. One
warm-up set, then timed sets of fresh prompts (the prefix cache cannot help);
medians reported. The engine runs with async scheduling on (what a
throughput-minded deployment sets; `--sync` measures it off) and decode bursts
of 8 iterations (`--decode-steps`; a comma list such as 8,1 builds one engine
per value and runs each timed set on each engine in turn, alternating the
order, so their ratio is measured in the same phase of the machine; the first
value's rate is the one compared with transformers).

For the 150M model the script also measures the machine's matmul peak with
XLA at the model's own weight shapes (and, for comparison, the engine's own
packed-weight matmul kernel at 32 rows), at a decode-sized batch (32 rows: the
issue's measure) and at a prefill-sized one (2048 rows), and reports the
fraction of the decode-sized peak the engine reaches, and the fraction of a
mixed roofline: the time the workload's prefill FLOPs would take at the
prefill-sized peak plus its decode FLOPs at the decode-sized peak. Those
peaks reuse one cache-resident weight; a decode step streams every weight from
memory, so the script also measures 32-row matmuls over weights too many to
cache, the rate a memory-bound decode step can reach at best.

`--dtype float32,bfloat16` does the same across serving dtypes (each engine
loads the float32 checkpoint in that dtype; every (dtype, decode_steps) pair
is one engine, alternating), and for the 150M model reports the bfloat16
kernel's own matmul rate (AMX / AVX512_BF16, where the CPU has them) at 32 and
2048 rows, the peak that dtype's engine is measured against.

    .venv/bin/python bench/throughput.py [--models tiny,150m] [--sets 3] [--hf-sets 1] [--sync]
        [--decode-steps 8] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MODEL_SHAPES, make_checkpoint, timed, workload_w1

NEW_TOKENS = 64


@dataclass(frozen=True)
class Variant:
    """One engine of the comparison: its serving dtype and decode burst length."""

    dtype: str
    decode_steps: int

    def __str__(self) -> str:
        return f"{self.dtype}, decode_steps={self.decode_steps}"


def engine_tokens_per_s(model_dir: Path, sets: list[list[list[int]]], async_scheduling: bool,
                        variants: list[Variant]) -> dict[Variant, tuple[float, list[float], float]]:
    """{variant: (median tok/s, per-set tok/s, load + warm-up seconds)}.

    One engine per variant, all in this process; each timed set runs on every
    engine in turn (order alternating by round), so the engines see the same
    prompts and the same phases of a drifting machine.
    """
    from esurge import CacheConfig, Config, SamplingParams, SchedulerConfig, eSurge

    config = Config(
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=256,
                        chunked_prefill_enabled=True, max_num_seq_buckets=(8, 16, 32),
                        async_scheduling=async_scheduling),
        CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=True),
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engines: dict[Variant, eSurge] = {}
    compile_s: dict[Variant, float] = {}
    rates: dict[Variant, list[float]] = {v: [] for v in variants}
    try:
        for v in variants:
            start = time.perf_counter()
            engines[v] = eSurge(model_dir, config, show_progress=False,
                                decode_steps=v.decode_steps, dtype=v.dtype)
            compile_s[v] = time.perf_counter() - start
            engines[v].generate(sets[0], params)
        for r, prompts in enumerate(sets[1:]):
            for v in variants if r % 2 == 0 else variants[::-1]:
                seconds = timed(lambda p=prompts, e=engines[v]: e.generate(p, params))
                rates[v].append(len(prompts) * NEW_TOKENS / seconds)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {v: (statistics.median(rates[v]), rates[v], compile_s[v]) for v in variants}


def hf_tokens_per_s(model_dir: Path, sets: list[list[list[int]]]) -> tuple[float, list[float]]:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None

    def run(prompts: list[list[int]]) -> None:
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)

    run(sets[0][:4])
    rates = [len(p) * NEW_TOKENS / timed(lambda p=p: run(p)) for p in sets[1:]]
    return statistics.median(rates), rates


def matmul_peak_flops(hidden: int, inter: int, tokens: int = 32, cold: bool = False,
                      packed: bool = False, dtype: str = "float32") -> float:
    """Best FLOP/s of XLA matmuls at the model's weight shapes, `tokens` rows each.

    cold: cycle through enough copies of each weight (>= 512 MiB) that every
    matmul streams its weight from memory, as a forward pass over the whole
    model does; otherwise one weight stays cache-resident.
    packed: the engine's own matmul instead (weights packed in panels, the CPU
    kernel of esurge.models.packed_linear).
    dtype: of the operands (bfloat16 with packed: the bfloat16 kernel).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from esurge.models.packed_linear import pack_weight, packed_matmul

    best = 0.0
    for k, n in ((hidden, hidden), (hidden, inter), (inter, hidden), (hidden, 4096)):
        width = jnp.dtype(dtype).itemsize
        copies = max(1, (512 << 20) // (width * k * n)) if cold else 1
        x = jnp.asarray(np.random.rand(tokens, k), dtype)
        weights = [jnp.asarray(np.random.rand(k, n), dtype) for _ in range(copies)]
        if packed:
            weights = [pack_weight(w) for w in weights]
            f = jax.jit(lambda a, b, n=n: packed_matmul(a, b, n))
        else:
            f = jax.jit(lambda a, b: a @ b)
        f(x, weights[0]).block_until_ready()
        reps = max(5, 200 * 32 // tokens, 2 * copies)
        start = time.perf_counter()
        for i in range(reps):
            out = f(x, weights[i % copies])
        out.block_until_ready()
        best = max(best, 2 * tokens * k * n * reps / (time.perf_counter() - start))
        del weights
    return best


def workload_flops(shape: str, sets: list[list[int]], vocab: int = 4096
                   ) -> tuple[float, float]:
    """Matmul FLOPs of one W1 set, (prefill, decode): 2 * params * tokens plus
    attention scores, the prompt's tokens counted as prefill."""
    hidden, layers, heads, kv_heads, inter = MODEL_SHAPES[shape]
    head_dim = hidden // heads
    per_token = layers * (2 * hidden * (hidden + 2 * kv_heads * head_dim + hidden)
                          + 2 * 3 * hidden * inter) + 2 * hidden * vocab
    prefill = decode = 0.0
    for prompt in sets:
        n, total = len(prompt), len(prompt) + NEW_TOKENS
        attention = layers * 4 * heads * head_dim / 2  # causal QK^T and PV, per (query, key)
        prefill += per_token * n + attention * n * n
        decode += per_token * NEW_TOKENS + attention * (total * total - n * n)
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,150m")
    parser.add_argument("--sets", type=int, default=3, help="timed sets (after one warm-up)")
    parser.add_argument("--hf-sets", type=int, default=1,
                        help="timed sets for transformers (0: skip transformers)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--sync", action="store_true", help="async scheduling off")
    parser.add_argument("--decode-steps", default="8",
                        help="decode iterations per burst; a comma list measures each")
    parser.add_argument("--dtype", default="float32",
                        help="serving dtype; a comma list (float32,bfloat16) measures each")
    args = parser.parse_args()
    if args.hf_sets < 0 or args.sets < 1:
        parser.error(f"--sets must be >= 1 and --hf-sets >= 0, got {args.sets} and "
                     f"{args.hf_sets}")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="esurge-bench-"))
    for shape in args.models.split(","):
        model_dir = make_checkpoint(workdir / shape, shape)
        sets = workload_w1(model_dir, num_sets=1 + args.sets)
        variants = [Variant(d, int(k)) for d in args.dtype.split(",")
                    for k in args.decode_steps.split(",")]
        results = engine_tokens_per_s(model_dir, sets, not args.sync, variants)
        hf = hf_tokens_per_s(model_dir, sets[:1 + args.hf_sets]) if args.hf_sets else None
        first = variants[0]
        for v, (rate, runs, compile_s) in results.items():
            versus = "" if v == first else f", {rate / results[first][0]:.2f}x the first"
            print(f"[{shape}] eSurge ({v}) {rate:,.0f} tok/s (runs "
                  f"{[round(r) for r in runs]}, warm-up+load {compile_s:.1f}s{versus})"
                  + ("" if hf is None else
                     f" | transformers {hf[0]:,.0f} tok/s (runs {[round(r) for r in hf[1]]}) "
                     f"| ratio {rate / hf[0]:.2f}x"))
        ours = results[first][0]
        if shape == "150m":
            hidden, _, _, _, inter = MODEL_SHAPES[shape]
            peak, prefill_peak = matmul_peak_flops(hidden, inter), matmul_peak_flops(
                hidden, inter, tokens=2048)
            streamed = matmul_peak_flops(hidden, inter, cold=True)
            prefill, decode = workload_flops(shape, sets[1])
            seconds = len(sets[1]) * NEW_TOKENS / ours
            achieved = (prefill + decode) / seconds
            ideal = prefill / prefill_peak + decode / peak
            print(f"[{shape}] matmul peak {peak / 1e9:.1f} GFLOP/s at 32 rows, "
                  f"{prefill_peak / 1e9:.1f} at 2048 rows; engine {achieved / 1e9:.1f} GFLOP/s = "
                  f"{achieved / peak:.0%} of the 32-row peak; mixed roofline "
                  f"{ideal:.2f}s vs {seconds:.2f}s = {ideal / seconds:.0%}")
            print(f"[{shape}] 32-row matmuls streaming their weights from memory (as a decode "
                  f"step does): {streamed / 1e9:.1f} GFLOP/s; engine = "
                  f"{achieved / streamed:.0%} of it")
            own, own_streamed = (matmul_peak_flops(hidden, inter, packed=True),
                                 matmul_peak_flops(hidden, inter, cold=True, packed=True))
            print(f"[{shape}] the engine's own packed matmul at 32 rows: {own / 1e9:.1f} GFLOP/s "
                  f"cached, {own_streamed / 1e9:.1f} streamed; engine = {achieved / own:.0%} "
                  f"of the cached one")
            for v, (rate, _, _) in results.items():
                if v.dtype != "bfloat16":
                    continue
                bf16 = [matmul_peak_flops(hidden, inter, tokens=t, packed=True, dtype="bfloat16")
                        for t in (32, 2048)]
                done = (prefill + decode) / (len(sets[1]) * NEW_TOKENS / rate)
                print(f"[{shape}] bfloat16 kernel peak: {bf16[0] / 1e9:.1f} GFLOP/s at 32 rows, "
                      f"{bf16[1] / 1e9:.1f} at 2048 rows; engine ({v}) {done / 1e9:.1f} GFLOP/s"
                      f" = {done / bf16[0]:.0%} of the 32-row bfloat16 peak")


if __name__ == "__main__":
    main()
