"""Scheduler overhead: microseconds per schedule() + update_from_output() pair.

N requests are prefilled, then every step decodes one token for each of them
(ignore_eos, max_tokens far away) with a hand-made ModelRunnerOutput, so the
numbers are the scheduler's own cost per engine step (the KV cache manager
included), with no model. Prints the median over several runs of each run's
median step time, as wall time and as this thread's CPU time: on a shared
machine the OS deschedules long steps, which inflates wall time but not CPU
time. Goal: under 1 ms per step at 256 running requests.

    .venv/bin/python bench/scheduler.py [--steps 200] [--runs 5] [--profile 256]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from esurge.config import CacheConfig, Config, SchedulerConfig
from esurge.core import CacheGroupsConfig, FullAttentionSpec, KVCacheGroup
from esurge.outputs import ModelRunnerOutput
from esurge.request import EngineRequest
from esurge.sampling_params import SamplingParams
from esurge.scheduler import Scheduler

PROMPT_LEN = 32
PAGE_SIZE = 16
MAX_MODEL_LEN = 4096


def build(num_requests: int, steps: int) -> Scheduler:
    """A scheduler holding num_requests prefilled requests, each one token into decode."""
    pages_each = -(-(PROMPT_LEN + steps + 2) // PAGE_SIZE)
    num_pages = num_requests * pages_each + 1
    config = Config(
        SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=max(
            MAX_MODEL_LEN, num_requests * PROMPT_LEN), max_model_len=MAX_MODEL_LEN),
        CacheConfig(num_pages=num_pages, page_size=PAGE_SIZE, enable_prefix_caching=True),
    )
    spec = FullAttentionSpec(page_size=PAGE_SIZE, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    scheduler = Scheduler(config, CacheGroupsConfig(num_pages, (KVCacheGroup((0,), spec),)))
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - PROMPT_LEN, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 131 + t * 7) % 32000 for t in range(PROMPT_LEN)]
        scheduler.add_request(EngineRequest(f"req-{i}", prompt, params, eos_token_id=2))
    out = scheduler.schedule()
    scheduler.update_from_output(out, one_token_each(list(out.num_scheduled_tokens)))
    return scheduler


def one_token_each(req_ids: list[str]) -> ModelRunnerOutput:
    """What a runner returns for a pure decode step: one sampled token per request."""
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                             [[17] for _ in req_ids])


def time_run(num_requests: int, steps: int) -> tuple[float, float]:
    """Median (wall, CPU) microseconds per step pair over one run of `steps` decode steps."""
    scheduler = build(num_requests, steps)
    first = scheduler.schedule()
    runner_output = one_token_each(list(first.num_scheduled_tokens))
    scheduler.update_from_output(first, runner_output)
    wall: list[float] = []
    cpu: list[float] = []
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for _ in range(steps):
        start, cpu_start = wall_clock(), cpu_clock()
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output)
        cpu.append((cpu_clock() - cpu_start) / 1000)
        wall.append((wall_clock() - start) / 1000)
        if len(out.num_scheduled_tokens) != num_requests:
            raise RuntimeError(f"expected {num_requests} decodes, got "
                               f"{len(out.num_scheduled_tokens)}")
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--profile", type=int, default=None,
                        help="profile one run with this many requests instead")
    args = parser.parse_args()
    if args.profile is not None:
        profiler = cProfile.Profile()
        profiler.runcall(time_run, args.profile, args.steps)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
        return
    print(f"{'running':>8} {'wall us/step':>13} {'cpu us/step':>12} {'cpu us/request':>15}"
          "  wall medians of the runs")
    for size in args.sizes:
        results = [time_run(size, args.steps) for _ in range(args.runs)]
        wall = statistics.median(r[0] for r in results)
        cpu = statistics.median(r[1] for r in results)
        runs = " ".join(f"{r[0]:.0f}" for r in results)
        print(f"{size:>8} {wall:>13.1f} {cpu:>12.1f} {cpu / size:>15.2f}  [{runs}]")


if __name__ == "__main__":
    main()
