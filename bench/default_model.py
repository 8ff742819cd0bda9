"""The default model (SmolLM2-135M-Instruct, the packaged Q4_1 GGUF) at batch 1 and 32:
time to first token and tokens/s, eSurge against transformers on the same
dequantized weights, in the same run.

    .venv/bin/python bench/default_model.py [--runs 3] [--new-tokens 64]

Both sides run greedy, float32, on the same chat prompts (rendered with the
model's chat template). Medians over --runs; the machine's noise is large, so
compare the ratios printed, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Name three fruits.",
    "Write a haiku about the sea.", "What is 12 times 7?", "Who wrote Hamlet?",
    "Explain photosynthesis briefly.", "What is a prime number?",
]


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` chat prompts (the questions, cycled, numbered so none share a prefix tail)."""
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def engine_run(llm: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(tokens/s over the batch, median time to first token in seconds)."""
    from esurge import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    ttfts = [o.metrics.time_to_first_token for o in outputs if o.metrics is not None]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / wall, statistics.median(t for t in ttfts if t is not None)


def hf_run(model: Any, tokenizer: Any, prompts: list[list[int]],
           new_tokens: int) -> tuple[float, float]:
    """(tokens/s, time to first token) of transformers' generate on a left-padded batch."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"attention_mask": mask, "do_sample": False, "eos_token_id": None,
              "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        wall = time.perf_counter() - start
    return len(prompts) * new_tokens / wall, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,32")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esurge import CacheConfig, Config, SchedulerConfig, eSurge
    from esurge.packaged import DEFAULT_MODEL, fetch_packaged

    path: Path = fetch_packaged(DEFAULT_MODEL)
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    batches = [int(b) for b in args.batches.split(",")]
    config = Config(
        SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=1024,
                        max_model_len=512, chunked_prefill_enabled=True, async_scheduling=True),
        CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=False))
    llm = eSurge(path, config, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    print(f"SmolLM2-135M-Instruct Q4_1 -> float32, {args.new_tokens} new tokens, "
          f"median of {args.runs} runs")
    print(f"{'batch':>5} {'eSurge tok/s':>13} {'TTFT ms':>8} {'HF tok/s':>9} {'TTFT ms':>8} "
          f"{'ratio':>6}")
    for batch in batches:
        prompts = chat_prompts(tokenizer, batch)
        engine_run(llm, prompts, 4)  # touch the code paths once
        ours = [engine_run(llm, prompts, args.new_tokens) for _ in range(args.runs)]
        theirs = [hf_run(hf, tokenizer, prompts, args.new_tokens) for _ in range(args.runs)]
        tps, ttft = (statistics.median(x) for x in zip(*ours, strict=True))
        hf_tps, hf_ttft = (statistics.median(x) for x in zip(*theirs, strict=True))
        print(f"{batch:>5} {tps:>13.1f} {ttft * 1e3:>8.0f} {hf_tps:>9.1f} {hf_ttft * 1e3:>8.0f} "
              f"{tps / hf_tps:>5.2f}x")
    llm.shutdown()


if __name__ == "__main__":
    main()
