"""Tensor parallelism on simulated CPU devices: step time, warm-up, per-device memory.

    .venv/bin/python bench/tensor_parallel.py [--degrees 1,2,4] [--reps 3]
        [--requests 8] [--new-tokens 32] [--eagle] [--json PATH]

The model is a random Llama built here with transformers (hidden 512, 8
layers, 8 query and 4 kv heads, MLP 1536, vocabulary 8192, float32; about
37 M parameters), cached under ~/.cache/esurge/bench/. For each degree one
engine (max_num_seqs 8, 64-token steps, 64 pages of 16 tokens, warm-up on)
reports:

- warm-up: eSurge's warm-up seconds (the persistent compile cache is turned
  off for this process, so every degree compiles from scratch);
- memory: parameter and KV cache bytes held by device 0;
- step time: --reps timed runs of --requests prompts of 24 tokens, each
  decoding --new-tokens tokens greedily; the run's wall time per token of
  one request (each step decodes all --requests rows; prefill steps count
  too), from the median tokens/s of the runs.

The degrees run alternately in one process (the simulated devices are
XLA_FLAGS=--xla_force_host_platform_device_count=8, set here). --eagle
first runs models/tiny-stdlib with its Eagle head at each degree. They share
the machine's cores, so a degree > 1 shows the cost of the split
(collectives, smaller matmuls, lost CPU-kernel packing), not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["ESURGE_COMPILE_CACHE"] = ""  # off: every degree compiles from scratch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from esurge import ParallelConfig, SamplingParams, eSurge
from esurge.config import CacheConfig, Config, SchedulerConfig

MODEL_DIR = Path.home() / ".cache/esurge/bench/tp-llama-37m"
SHAPE = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "max_position_embeddings": 256}


def _model() -> Path:
    if (MODEL_DIR / "config.json").is_file():
        return MODEL_DIR
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(MODEL_DIR, safe_serialization=True)
    return MODEL_DIR


def _config() -> Config:
    return Config(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                                  chunked_prefill_enabled=True, max_num_seq_buckets=(8,)),
                  CacheConfig(num_pages=64, page_size=16, enable_prefix_caching=False))


def _device0_bytes(tree: Any) -> int:
    device = jax.devices()[0]
    return sum(s.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
               for s in leaf.addressable_shards if s.device == device)


def _timed_run(llm: eSurge, requests: int, new_tokens: int, seed: int) -> tuple[float, int]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, SHAPE["vocab_size"], 24).tolist() for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def _eagle(degrees: list[int], reps: int) -> None:
    """models/tiny-stdlib with its Eagle-3 head (k=3; the head replicated on
    every device): tokens/s and acceptance per degree, 4 prompts of 128 held-out
    tokens, 64 new tokens each, greedy."""
    from bench.spec_decode import held_out_prompts
    from esurge import SpeculativeConfig

    model, head = Path("models/tiny-stdlib"), Path("models/tiny-stdlib-eagle")
    config = Config(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                    max_model_len=256, chunked_prefill_enabled=True,
                                    max_num_seq_buckets=(4,)),
                    CacheConfig(num_pages=96, page_size=16, enable_prefix_caching=False),
                    SpeculativeConfig(3, str(head)))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    print(f"\nEagle (k=3)\n{'tp':>3} {'tok/s':>8} {'vs tp1':>7} {'accepted/step':>14}")
    base = None
    for tp in degrees:
        with eSurge(model, config, show_progress=False, parallel_config=ParallelConfig(tp)) as llm:
            llm.generate(held_out_prompts(model, 4, seed=99), params)
            rates = []
            for rep in range(reps):
                prompts = held_out_prompts(model, 4, seed=rep)
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                rates.append(sum(len(o.outputs[0].token_ids) for o in outs)
                             / (time.perf_counter() - start))
            stats = llm.runner.spec_stats
        rate = statistics.median(rates)
        base = base or rate
        accepted = stats.mean_acceptance_length if stats is not None else float("nan")
        print(f"{tp:>3} {rate:>8.1f} {rate / base:>7.2f} {accepted:>14.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--degrees", default="1,2,4")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--eagle", action="store_true",
                        help="also Eagle speculative decoding per degree (models/tiny-stdlib)")
    args = parser.parse_args()
    degrees = [int(d) for d in args.degrees.split(",")]
    if args.eagle:
        _eagle(degrees, args.reps)
    path = _model()
    engines = {}
    report: dict[int, dict[str, Any]] = {}
    for tp in degrees:
        llm = eSurge(path, _config(), show_progress=False, parallel_config=ParallelConfig(tp))
        engines[tp] = llm
        report[tp] = {"warmup_s": llm.warmup_seconds,
                      "params_bytes_device0": _device0_bytes(llm.model.params),
                      "kv_bytes_device0": _device0_bytes((llm.runner.kv_cache.keys,
                                                          llm.runner.kv_cache.values)),
                      "runs": []}
        _timed_run(llm, args.requests, args.new_tokens, seed=99)  # first-touch run
    for rep in range(args.reps):
        order = degrees if rep % 2 == 0 else degrees[::-1]
        for tp in order:
            report[tp]["runs"].append(_timed_run(engines[tp], args.requests, args.new_tokens,
                                                 seed=rep))
    base = None
    print(f"{'tp':>3} {'warm-up s':>10} {'params MiB/dev':>15} {'KV MiB/dev':>11} "
          f"{'tok/s':>8} {'ms/token-step':>14} {'vs tp1':>7}")
    for tp in degrees:
        row = report[tp]
        rates = [tokens / wall for wall, tokens in row["runs"]]
        rate = statistics.median(rates)
        # Every step decodes one token for each of the --requests rows.
        step_ms = 1000 * args.requests / rate
        base = base or rate
        row.update(tok_s=rate, step_ms=step_ms)
        print(f"{tp:>3} {row['warmup_s']:>10.1f} {row['params_bytes_device0'] / 2**20:>15.1f} "
              f"{row['kv_bytes_device0'] / 2**20:>11.2f} {rate:>8.1f} {step_ms:>14.1f} "
              f"{rate / base:>7.2f}")
    for llm in engines.values():
        llm.shutdown()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
