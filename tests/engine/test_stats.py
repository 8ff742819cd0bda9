"""The stats the engine loop publishes: exact counts, read from any thread."""

from __future__ import annotations

import ast
from pathlib import Path

from esurge import SamplingParams, eSurge

SERVICE_DIR = Path(__file__).resolve().parents[2] / "service"


def test_stats_count_a_request_once_it_is_delivered(engine: eSurge) -> None:
    before = engine.stats
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [out] = engine.generate([[5, 6, 7, 8]], params)
    after = engine.stats  # published before the final output was delivered
    assert len(out.outputs[0].token_ids) == 6
    assert after.num_generation_tokens - before.num_generation_tokens == 6
    assert after.num_prompt_tokens - before.num_prompt_tokens == 4
    assert after.num_steps - before.num_steps >= 6
    assert (after.num_running, after.num_waiting) == (0, 0)
    assert after.num_free_pages == after.num_usable_pages == after.num_pages - 1
    assert after.kv_cache_usage == 0.0
    assert after.total_step_seconds > before.total_step_seconds
    assert after.timestamp > before.timestamp


def test_prefix_hits_are_counted(engine: eSurge) -> None:
    prompt = list(range(100, 140))  # 5 full pages of 8
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.generate([prompt], params)
    before = engine.stats
    engine.generate([prompt], params)
    after = engine.stats
    assert after.prefix_cache_hits - before.prefix_cache_hits == 32  # all but the last page
    assert after.num_cached_pages >= 4


def test_the_service_reads_no_engine_internals() -> None:
    # Only the loop thread may touch these; the service reads engine.stats.
    forbidden = {"scheduler", "kv_cache_manager", "runner", "input_batch"}
    found = []
    for path in sorted(SERVICE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in forbidden:
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert found == []
