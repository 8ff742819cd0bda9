"""Preemption and resumption, finish_requests, events and per-client finished sets."""

from __future__ import annotations

import pytest

from esurge.core import CacheGroupsConfig, FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from esurge.engine_types import EngineCoreEventType, FinishReason
from esurge.request import EngineRequestStatus
from esurge.scheduler import Scheduler
from tests.scheduler.fakes import (
    Collected,
    FakeRunner,
    make_config,
    make_request,
    make_scheduler,
    reference_output,
    run,
)

ABORTED = EngineRequestStatus.FINISHED_ABORTED
E = EngineCoreEventType


def prompts(count: int) -> list[list[int]]:
    return [[(7 * k + t) % 40 + 1 for t in range(5 + k % 4)] for k in range(count)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [False, True])
def test_tiny_page_budget_preempts_and_output_is_unchanged(policy: str, chunked: bool) -> None:
    reqs = prompts(6)
    tight = make_scheduler(num_pages=9, page_size=2, policy=policy, chunked=chunked,
                           max_num_batched_tokens=64, threshold=3)
    roomy = make_scheduler(num_pages=200, page_size=2, policy=policy)
    for s in (tight, roomy):
        for k, p in enumerate(reqs):
            s.add_request(make_request(f"r{k}", p, 8, priority=k % 3, ignore_eos=True))
    tight_run, roomy_run = run(tight), run(roomy)
    preemptions = sum(r.num_preemptions for r in tight.waiting) + sum(
        len([e for e in o.events or () if e.type is E.PREEMPTED])
        for outs in tight_run.outputs.values() for o in outs)
    assert preemptions > 0
    for k, p in enumerate(reqs):
        assert tight_run.tokens[f"r{k}"] == roomy_run.tokens[f"r{k}"] == reference_output(p, 8)
        assert tight_run.reason(f"r{k}") is FinishReason.LENGTH
    kv = tight.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)


def test_resumed_request_is_sent_again_in_full_ahead_of_waiting_ones() -> None:
    # 4 usable pages of 4: a and b hold one page each after prefill, then both
    # need a second and a third; b (admitted last) is evicted and comes back
    # before d, which waited all along (max_num_seqs=2).
    s = make_scheduler(num_pages=5, max_num_seqs=2)
    a = make_request("a", [1, 2, 3, 4], 8, ignore_eos=True)
    b = make_request("b", [5, 6, 7, 8], 8, ignore_eos=True)
    d = make_request("d", [9, 10, 11], 2, ignore_eos=True)
    for r in (a, b, d):
        s.add_request(r)
    runner = FakeRunner(4)
    got = Collected()
    admitted: list[str] = []
    resumed = None
    while s.has_requests():
        out = s.schedule()
        if "b" in out.preempted_req_ids:
            assert b.status is EngineRequestStatus.PREEMPTED and b.num_computed_tokens == 0
            preempted_outputs = list(b.output_token_ids)
        for new in out.scheduled_new_reqs:
            admitted.append(new.req_id)
            if new.req_id == "b" and b.num_preemptions:
                resumed = new
        got.add(s.update_from_output(out, runner.execute(out)))
    assert admitted == ["a", "b", "b", "d"]
    assert resumed is not None and b.num_preemptions == 1
    assert resumed.output_token_ids == tuple(preempted_outputs)
    assert resumed.prompt_token_ids == [5, 6, 7, 8]
    assert resumed.num_computed_tokens >= 4  # its own prompt page is a prefix hit
    assert {o.num_cached_tokens for o in got.outputs["b"]} == {0}  # as first admitted
    assert got.tokens["b"] == reference_output([5, 6, 7, 8], 8)
    types = [e.type for o in got.outputs["b"] for e in o.events or ()]
    assert types == [E.QUEUED, E.SCHEDULED, E.PREEMPTED, E.SCHEDULED]
    stamps = [e.timestamp for o in got.outputs["b"] for e in o.events or ()]
    assert stamps == sorted(stamps)


def test_finish_requests_frees_pages_at_once_and_reports_the_end() -> None:
    s = make_scheduler(max_num_seqs=1, include_finished_set=True)
    s.add_request(make_request("a", 8, 8, ignore_eos=True))
    s.add_request(make_request("b", 4, 8, ignore_eos=True))
    s.add_request(make_request("c", 4, 8, ignore_eos=True))
    runner = FakeRunner(4)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    kv = s.kv_cache_manager
    out = s.schedule()  # a decodes; then a is aborted before the step's output arrives
    assert kv.num_free_pages == kv.num_usable_pages - 3  # 8 prompt tokens + the 9th
    s.finish_requests("a", ABORTED)
    s.finish_requests(["b", "unknown"], ABORTED)
    assert kv.num_free_pages == kv.num_usable_pages
    assert s.get_request_counts() == (0, 1) and s.has_finished_requests()
    result = s.update_from_output(out, runner.execute(out))
    finals = {o.request_id: o for o in result[0].outputs}
    assert set(finals) == {"a", "b"}
    assert all(o.finish_reason is FinishReason.ABORT and o.new_token_ids == []
               for o in finals.values())
    assert result[0].finished_requests == {"a", "b"}
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and list(out.num_scheduled_tokens) == ["c"]
    assert not s.has_finished_requests()


def test_finish_requests_needs_a_finished_status() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="finished_status"):
        s.finish_requests("a", EngineRequestStatus.RUNNING)


def test_stop_string_end_through_finish_requests_reports_stop() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 4, 8))
    runner = FakeRunner(4)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.finish_requests("a", EngineRequestStatus.FINISHED_STOPPED)
    result = s.update_from_output(s.schedule(), runner.execute(s.schedule()))
    assert [(o.request_id, o.finish_reason) for o in result[0].outputs] == [
        ("a", FinishReason.STOP)]


def test_outputs_go_to_their_client_with_finished_sets() -> None:
    s = make_scheduler(include_finished_set=True)
    s.add_request(make_request("a", 4, 1, client=0))
    s.add_request(make_request("b", 4, 2, client=1, ignore_eos=True))
    s.add_request(make_request("c", 4, 3, client=1, ignore_eos=True))
    runner = FakeRunner(4)
    out = s.schedule()
    result = s.update_from_output(out, runner.execute(out))
    assert sorted(result) == [0, 1]
    assert [o.request_id for o in result[0].outputs] == ["a"]
    assert [o.request_id for o in result[1].outputs] == ["b", "c"]
    assert (result[0].finished_requests, result[1].finished_requests) == ({"a"}, set())
    out = s.schedule()
    result = s.update_from_output(out, runner.execute(out))
    assert list(result) == [1] and result[1].finished_requests == {"b"}


def test_finished_set_is_none_unless_asked() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 4, 1))
    got = run(s)
    assert got.finished_sets == []
    assert got.reason("a") is FinishReason.LENGTH


def test_shutdown_aborts_everything_and_frees_the_pool() -> None:
    s = make_scheduler()
    for rid in "ab":
        s.add_request(make_request(rid, 6, 8))
    runner = FakeRunner(4)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.shutdown()
    kv = s.kv_cache_manager
    assert s.get_num_unfinished_requests() == 0
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)
    out = s.schedule()
    result = s.update_from_output(out, runner.execute(out))
    assert {o.request_id: o.finish_reason for o in result[0].outputs} == {
        "a": FinishReason.ABORT, "b": FinishReason.ABORT}
    assert s.reset_prefix_cache() is True


def test_full_and_sliding_window_groups_share_the_pool() -> None:
    full = FullAttentionSpec(page_size=2, num_kv_heads=1, head_dim=8)
    window = SlidingWindowSpec(page_size=2, num_kv_heads=1, head_dim=8, sliding_window=4)
    groups = CacheGroupsConfig(24, (KVCacheGroup((0,), full), KVCacheGroup((1,), window)))
    config, _ = make_config(page_size=2, num_pages=24, chunked=True,
                            max_num_batched_tokens=6, margin=2)
    s = Scheduler(config, groups)
    assert s.reserve_pages_per_request == 2  # one page of margin in each group
    reqs = prompts(5)
    for k, p in enumerate(reqs):
        s.add_request(make_request(f"r{k}", p, 10, ignore_eos=True))
    out = s.schedule()
    for new in out.scheduled_new_reqs:
        assert len(new.page_ids) == 2 and len(new.page_ids[0]) == len(new.page_ids[1])
    runner = FakeRunner(2)
    got = Collected()
    got.add(s.update_from_output(out, runner.execute(out)))
    run(s, runner, collected=got)
    for k, p in enumerate(reqs):
        assert got.tokens[f"r{k}"] == reference_output(p, 10)
    kv = s.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)
