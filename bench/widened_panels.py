"""A bfloat16 checkpoint served in float32: widened panels against upcast ones.

Where the CPU has no bfloat16 dot products, a bfloat16 checkpoint serves in
float32. By default its projections keep the checkpoint's own two-byte values
(cpu_kernels/widened_matmul.cc widens them in registers); ESURGE_WIDENED_PANELS=0
upcasts them to float32 panels at load, as before. Both compute the same
products bit for bit, so this compares speed only, and checks the tokens are
identical.

Two engines in this process over the same bfloat16 checkpoint (the 150M
Llama of bench/common.py, random weights, stored in bfloat16), one per layout;
each timed set (W1 prompts, greedy, --new-tokens each) runs on both, the order
alternating, at each batch size in --batches; medians of --sets.

    .venv/bin/python bench/widened_panels.py [--model 150m] [--batches 1,8] [--sets 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import MODEL_SHAPES, make_checkpoint, timed, workload_w1

LAYOUTS = {"widened": "1", "upcast": "0"}  # ESURGE_WIDENED_PANELS at load


def _load(model_dir: Path, widened: str, max_batch: int) -> Any:
    from esurge import CacheConfig, Config, SchedulerConfig, eSurge

    config = Config(
        SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=1024, max_model_len=512,
                        chunked_prefill_enabled=True, async_scheduling=True),
        CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=False))
    os.environ["ESURGE_WIDENED_PANELS"] = widened
    try:
        # float32 whatever the CPU: on one with AVX512_BF16, auto would serve bfloat16.
        return eSurge(model_dir, config, show_progress=False, dtype="float32")
    finally:
        del os.environ["ESURGE_WIDENED_PANELS"]


def _weight_bytes(llm: Any) -> int:
    import jax

    return sum(leaf.nbytes for leaf in jax.tree.leaves(llm.runner.model.model_state.params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="150m")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--sets", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    from esurge import SamplingParams
    from esurge.models.cpu_kernels import cpu_has_avx512, cpu_has_bf16_dot

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="esurge-bench-"))
    model_dir = make_checkpoint(workdir / f"{args.model}-bf16", args.model, dtype="bfloat16")
    batches = [int(b) for b in args.batches.split(",")]
    if cpu_has_bf16_dot():
        print("note: this CPU multiplies bfloat16 natively; `auto` would serve bfloat16 here "
              "(both engines below are asked for float32)")
    engines = {name: _load(model_dir, flag, max(batches)) for name, flag in LAYOUTS.items()}
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = [p for s in workload_w1(model_dir, num_sets=1 + args.sets, per_set=max(batches))
               for p in s]
    print(f"{args.model} bfloat16 checkpoint served in float32, AVX-512: {cpu_has_avx512()}; "
          + ", ".join(f"{name} {engines[name].runner.model.config.coded_weights or 'float32'}"
                      f" ({_weight_bytes(llm) / 2**20:.0f} MiB of weights)"
                      for name, llm in engines.items()))
    try:
        for batch in batches:
            rates: dict[str, list[float]] = {name: [] for name in engines}
            outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
            for r in range(1 + args.sets):
                chunk = prompts[r * batch:(r + 1) * batch]
                for name in (list(engines) if r % 2 else list(engines)[::-1]):
                    done: list[Any] = []
                    seconds = timed(lambda c=chunk, n=name, d=done: d.extend(
                        engines[n].generate(c, params)))
                    outputs[name].extend(list(o.outputs[0].token_ids) for o in done)
                    if r:  # the first set warms up
                        rates[name].append(batch * args.new_tokens / seconds)
            same = outputs["widened"] == outputs["upcast"]
            wide, up = (statistics.median(rates[n]) for n in ("widened", "upcast"))
            runs = {n: [round(x) for x in rates[n]] for n in rates}
            print(f"batch {batch:>3}: widened {wide:7.1f} tok/s {runs['widened']} | upcast "
                  f"{up:7.1f} tok/s {runs['upcast']} | {wide / up:.2f}x | identical tokens: "
                  f"{same}", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
