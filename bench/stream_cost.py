"""Host time per engine step while one request streams 4,096 tokens.

A random micro Llama (hidden 64, 2 layers, vocab 512, tokenizer trained
here) streams one greedy request of --tokens tokens. The engine's outputs of
every step are recorded, then replayed through the host path alone, timed
per step with the thread's CPU clock:

- engine: what the loop thread does for a streaming subscriber after the
  device step: `OutputProcessor.process` (detokenizing) and building the item
  the subscriber gets (the per-step delta; before deltas, a snapshot of the
  whole cumulative output);
- service: turning that item into the Generate stream message
  (`service.responses`).

Each step's cost is its minimum over --repeats replays: free of the device
step's cache pollution and of other processes on the machine. The live
loop-thread time (end of the step to the callback) is printed too, for
reference; it also grows with the device step's footprint. It prints the mean over the first and the
last 256 tokens and their ratio; flat (near 1.0) means the cost per step does
not grow with the length of the output.

    .venv/bin/python bench/stream_cost.py [--tokens 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WINDOW = 256


def build_model(out: Path, max_len: int) -> Path:
    """The micro Llama and a 512-token tokenizer trained on standard-library source."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.tokenizer_training import stdlib_texts, train_bpe_tokenizer

    train_bpe_tokenizer(stdlib_texts(max_files=40), vocab_size=512, out_dir=out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    return out


def stream_one(engine: Any, tokens: int) -> tuple[list[float], list[Any]]:
    """Live per-step loop-thread seconds (step end -> callback) and each step's
    engine-core outputs."""
    from esurge import SamplingParams

    core, processor = engine.loop.core, engine.loop.processor
    step, process = core.step, processor.process
    step_end = [0.0]
    recorded: list[Any] = []

    def timed_step() -> Any:
        result = step()
        step_end[0] = time.thread_time()
        return result

    def recording_process(outputs: Any) -> Any:
        recorded.append(list(outputs))
        return process(outputs)

    # The bench's probes; the loop looks these methods up each step.
    core.step, processor.process = timed_step, recording_process
    costs: list[float] = []
    done = threading.Event()

    def on_output(item: Any) -> None:
        costs.append(time.thread_time() - step_end[0])
        if getattr(item, "finished", True):
            done.set()

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.submit([5, 6, 7, 8], params, on_output, request_id="long")
    if not done.wait(1800):
        raise RuntimeError("the request did not finish within 30 minutes")
    core.step, processor.process = step, process
    return costs, recorded


def replay(tokenizer: Any, tokens: int, recorded: list[Any]) -> tuple[list[float], list[float]]:
    """Per-step host seconds of the engine's and the service's part, replayed."""
    from esurge import SamplingParams
    from esurge.engine import request_output
    from esurge.engine.output_processor import OutputProcessor
    from service.responses import RequestCursor

    processor = OutputProcessor(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    processor.add_request("long", None, [5, 6, 7, 8], params)
    cursor = RequestCursor("long", 1, True, False)
    engine_costs, service_costs = [], []
    for outputs in recorded:
        began = time.thread_time()
        processed = processor.process(outputs)
        item: Any
        if hasattr(processed, "deltas"):
            item = processed.deltas[0]
        else:  # before deltas: the loop sent a snapshot of the cumulative output
            item = request_output.snapshot(processed.request_outputs[0])
        middle = time.thread_time()
        for delta in cursor.advance(item):
            cursor.generate_response(delta, with_prompt_ids=False,
                                     total_drafts=cursor.sample_totals(delta.index))
        engine_costs.append(middle - began)
        service_costs.append(time.thread_time() - middle)
    return engine_costs, service_costs


def report(name: str, costs: list[float]) -> None:
    first = statistics.mean(costs[1:WINDOW + 1])  # the first step also runs the prefill
    last = statistics.mean(costs[-WINDOW:])
    print(f"{name:8s} first {WINDOW}: {first * 1e6:8.1f} us/step   last {WINDOW}: "
          f"{last * 1e6:8.1f} us/step   last/first: {last / first:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7, help="replays of the recorded steps")
    args = parser.parse_args()
    from esurge import CacheConfig, Config, SchedulerConfig, eSurge

    max_len = args.tokens + 64
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), max_len)
        config = Config(
            SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=max_len,
                            chunked_prefill_enabled=True, max_num_seq_buckets=(1,)),
            CacheConfig(num_pages=max_len // 16 + 2, page_size=16, enable_prefix_caching=False))
        engine = eSurge(model_dir, config, show_progress=False)
        try:
            live, recorded = stream_one(engine, args.tokens)
            # Each step's minimum over the replays: the same work each time, so
            # the minimum drops what other processes on the machine added.
            runs = [replay(engine.tokenizer, args.tokens, recorded)
                    for _ in range(args.repeats)]
            engine_costs = [min(r[0][i] for r in runs) for i in range(len(recorded))]
            service_costs = [min(r[1][i] for r in runs) for i in range(len(recorded))]
        finally:
            engine.shutdown()
    generated = sum(len(o.new_token_ids) for step in recorded for o in step)
    print(f"{args.tokens} tokens requested, {generated} streamed in {len(recorded)} steps")
    report("engine", engine_costs)
    report("service", service_costs)
    report("live", live)


if __name__ == "__main__":
    main()
