"""Chunked prefill, the long-prefill threshold, whole-prompt admission and prefix hits."""

from __future__ import annotations

from esurge.scheduler import Scheduler
from tests.scheduler.fakes import (
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
    run,
)


def steps(scheduler: Scheduler, count: int, got: Collected | None = None
          ) -> list[dict[str, int]]:
    """Run count steps; the scheduled token counts of each."""
    runner = FakeRunner(scheduler.kv_cache_manager.page_size)
    plans: list[dict[str, int]] = []
    for _ in range(count):
        out = scheduler.schedule()
        plans.append(dict(out.num_scheduled_tokens))
        result = scheduler.update_from_output(out, runner.execute(out))
        if got is not None:
            got.add(result)
    return plans


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    s = make_scheduler(chunked=True, max_num_batched_tokens=8)
    prompt = list(range(3, 23))
    s.add_request(make_request("a", prompt, 2, ignore_eos=True))
    runner = FakeRunner(4)
    seen: list[tuple[int, int, int]] = []  # (scheduled, computed before, outputs produced)
    for _ in range(4):
        out = s.schedule()
        computed = ([n.num_computed_tokens for n in out.scheduled_new_reqs]
                    + out.scheduled_cached_reqs.num_computed_tokens)
        result = s.update_from_output(out, runner.execute(out))
        produced = sum(len(o.new_token_ids) for r in result.values() for o in r.outputs)
        seen.append((out.num_scheduled_tokens["a"], computed[0], produced))
    assert seen == [(8, 0, 0), (8, 8, 0), (4, 16, 1), (1, 20, 1)]
    assert s.get_num_unfinished_requests() == 0


def test_chunked_prefill_shares_the_budget_with_decodes() -> None:
    s = make_scheduler(chunked=True, max_num_batched_tokens=8)
    s.add_request(make_request("a", [1, 2, 3], 4, ignore_eos=True))
    s.add_request(make_request("b", list(range(10, 22)), 4, ignore_eos=True))
    assert steps(s, 3) == [{"a": 3, "b": 5}, {"a": 1, "b": 7}, {"a": 1, "b": 1}]


def test_threshold_caps_a_long_prompt_share_per_step() -> None:
    s = make_scheduler(chunked=True, max_num_batched_tokens=16, threshold=5)
    s.add_request(make_request("a", list(range(1, 13)), 2, ignore_eos=True))
    s.add_request(make_request("b", [30, 31, 32], 2, ignore_eos=True))
    assert steps(s, 3) == [{"a": 5, "b": 3}, {"a": 5, "b": 1}, {"a": 2}]


def test_threshold_zero_means_no_cap() -> None:
    s = make_scheduler(chunked=True, max_num_batched_tokens=16, threshold=0)
    s.add_request(make_request("a", list(range(1, 13)), 2, ignore_eos=True))
    s.add_request(make_request("b", [30, 31, 32], 2, ignore_eos=True))
    assert steps(s, 2) == [{"a": 12, "b": 3}, {"a": 1, "b": 1}]


def test_threshold_is_ignored_without_chunked_prefill() -> None:
    s = make_scheduler(max_num_batched_tokens=64, threshold=5)
    s.add_request(make_request("a", list(range(1, 13)), 2, ignore_eos=True))
    assert steps(s, 1) == [{"a": 12}]


def test_without_chunking_prompts_go_whole_and_keep_fcfs_order() -> None:
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16)
    s.add_request(make_request("a", list(range(1, 11)), 4, ignore_eos=True))
    s.add_request(make_request("b", list(range(11, 21)), 4, ignore_eos=True))
    s.add_request(make_request("c", [40, 41], 4, ignore_eos=True))
    # b (10) does not fit the 6 tokens left after a; c would, but must not overtake b.
    assert steps(s, 2) == [{"a": 10}, {"a": 1, "b": 10, "c": 2}]


def test_chunked_prefill_output_matches_reference() -> None:
    s = make_scheduler(chunked=True, max_num_batched_tokens=5, threshold=3)
    prompts = [list(range(k, k + 9 + k)) for k in range(4)]
    for k, p in enumerate(prompts):
        s.add_request(make_request(f"r{k}", p, 6, ignore_eos=True))
    got = run(s)
    for k, p in enumerate(prompts):
        assert got.tokens[f"r{k}"] == reference_output(p, 6)


def test_prefix_hit_on_a_repeated_prompt() -> None:
    prompt = list(range(5, 15))  # 10 tokens: 2 full pages of 4 can be reused
    s = make_scheduler()
    got = Collected()
    s.add_request(make_request("a", prompt, 3, ignore_eos=True))
    run(s, collected=got)
    s.add_request(make_request("b", prompt, 3, ignore_eos=True))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 2}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    runner = FakeRunner(4)
    got.add(s.update_from_output(out, runner.execute(out)))
    run(s, runner, collected=got)
    assert got.outputs["a"][0].num_cached_tokens == 0
    assert got.outputs["b"][0].num_cached_tokens == 8
    assert got.tokens["b"] == got.tokens["a"] == reference_output(prompt, 3)
    kv = s.kv_cache_manager
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)


def test_no_prefix_hits_when_caching_is_off() -> None:
    prompt = list(range(5, 15))
    s = make_scheduler(prefix_caching=False)
    s.add_request(make_request("a", prompt, 3, ignore_eos=True))
    run(s)
    s.add_request(make_request("b", prompt, 3, ignore_eos=True))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 10}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
