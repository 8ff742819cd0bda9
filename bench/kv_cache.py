"""Micro-benchmark of the KV cache manager (pure Python, page_size 16).

Measures, as medians over several runs:
- decode-sized requests: allocate_slots + free per second (1 page of prompt);
- prefill-sized requests: allocate_slots + free per second (512-token prompts);
- one decode step of 256 running requests (allocate_slots of 1 token each,
  1100-token contexts);
- get_computed_pages of a fully cached 4096-token prompt (hashing included).

Run: .venv/bin/python bench/kv_cache.py [--runs N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

from esurge.core import (
    CacheGroupsConfig,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheManager,
    SlidingWindowSpec,
)
from esurge.request import EngineRequest
from esurge.sampling_params import SamplingParams

PAGE_SIZE = 16
MAX_MODEL_LEN = 8192
PARAMS = SamplingParams()
# Wall time by default; --clock cpu counts this process's CPU time only, which
# stays meaningful on a machine shared with other busy processes.
_clock: Callable[[], float] = time.perf_counter


def make_manager(num_pages: int, hybrid: bool = False) -> KVCacheManager:
    spec = FullAttentionSpec(page_size=PAGE_SIZE, num_kv_heads=8, head_dim=128)
    groups = [KVCacheGroup((0,), spec)]
    if hybrid:
        window = SlidingWindowSpec(page_size=PAGE_SIZE, num_kv_heads=8, head_dim=128,
                                   sliding_window=1024)
        groups.append(KVCacheGroup((1,), window))
    return KVCacheManager(CacheGroupsConfig(num_pages=num_pages, groups=tuple(groups)),
                          MAX_MODEL_LEN)


def make_requests(count: int, length: int, tag: str) -> list[EngineRequest]:
    # Distinct first tokens so the requests share no prefix.
    return [EngineRequest(f"{tag}{i}", [i, *range(1, length)], PARAMS, None)
            for i in range(count)]


def alloc_free_rate(length: int, count: int, hybrid: bool) -> float:
    """Requests allocated (whole prompt, with lookup) and freed per second."""
    kv = make_manager(count * (length // PAGE_SIZE + 2) * 2 + 1, hybrid)
    reqs = make_requests(count, length, "r")
    start = _clock()
    for req in reqs:
        hits, num_hit = kv.get_computed_pages(req)
        kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    for req in reqs:
        kv.free(req)
    return count / (_clock() - start)


def decode_step_us(num_running: int, hybrid: bool, steps: int = 64) -> float:
    """Mean microseconds of allocate_slots(1 token) for all running requests, per step."""
    # 1100-token contexts: past the 1024-token window, so window pages go back too.
    kv = make_manager(num_running * 150 + 1, hybrid)
    reqs = make_requests(num_running, 1100, "d")
    for req in reqs:
        kv.allocate_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids([7])
    total = 0.0
    for _ in range(steps):
        start = _clock()
        for req in reqs:
            kv.allocate_slots(req, 1)
        total += _clock() - start
        for req in reqs:  # the model's part of the step, not timed
            req.num_computed_tokens += 1
            req.append_output_token_ids([7])
    return total / steps * 1e6


def lookup_4k_us(repeats: int = 20) -> float:
    """Microseconds of get_computed_pages for a fresh request whose 4096-token prompt is cached."""
    kv = make_manager(600)
    prompt = list(range(4096))
    warm = EngineRequest("warm", prompt, PARAMS, None)
    kv.allocate_slots(warm, 4096)
    warm.num_computed_tokens = 4096
    total = 0.0
    for i in range(repeats):
        req = EngineRequest(f"q{i}", prompt, PARAMS, None)
        start = _clock()
        _, num_hit = kv.get_computed_pages(req)
        total += _clock() - start
        if num_hit != 4096 - PAGE_SIZE:
            raise RuntimeError(f"expected a {4096 - PAGE_SIZE}-token hit, got {num_hit}")
        kv.free(req)
    return total / repeats * 1e6


def median_of(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per measurement")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: time.perf_counter; cpu: time.process_time")
    args = parser.parse_args()
    runs = args.runs
    global _clock
    _clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"page_size={PAGE_SIZE}, {args.clock} clock, medians of {runs} runs")
    for hybrid in (False, True):
        name = "full+sliding(1024)" if hybrid else "full"
        dec = median_of(runs, partial(alloc_free_rate, 16, 2000, hybrid))
        pre = median_of(runs, partial(alloc_free_rate, 512, 500, hybrid))
        step = median_of(runs, partial(decode_step_us, 256, hybrid))
        print(f"[{name}] allocate+free, 16-token requests : {dec:12,.0f} req/s")
        print(f"[{name}] allocate+free, 512-token requests: {pre:12,.0f} req/s")
        print(f"[{name}] decode step, 256 running requests : {step:12.1f} us "
              f"({step / 256:.2f} us/request)")
    look = median_of(runs, lookup_4k_us)
    print(f"get_computed_pages, 4096-token prompt fully cached: {look:10.1f} us")


if __name__ == "__main__":
    main()
