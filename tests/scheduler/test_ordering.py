"""Admission order (fcfs, priority), preemption victims, buckets and the safety margin."""

from __future__ import annotations

import pytest

from esurge.request import EngineRequest, EngineRequestStatus
from esurge.scheduler import Scheduler
from tests.scheduler.fakes import (
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
    run,
)


def admission_order(scheduler: Scheduler, requests: list[EngineRequest]) -> list[str]:
    for r in requests:
        scheduler.add_request(r)
    runner = FakeRunner(scheduler.kv_cache_manager.page_size)
    order: list[str] = []
    while scheduler.has_requests():
        out = scheduler.schedule()
        order.extend(n.req_id for n in out.scheduled_new_reqs)
        scheduler.update_from_output(out, runner.execute(out))
    return order


def mixed_priorities() -> list[EngineRequest]:
    return [
        make_request("x", 4, 1, priority=5, arrival=0.0),
        make_request("y", 4, 1, priority=1, arrival=2.0),
        make_request("z", 4, 1, priority=1, arrival=1.0),
        make_request("w", 4, 1, priority=3, arrival=0.0),
    ]


def test_fcfs_admits_by_arrival_up_to_max_num_seqs() -> None:
    s = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 4, 2, ignore_eos=True))
    runner = FakeRunner(4)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "b"]
    assert s.get_request_counts() == (2, 1)
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [4, 4]
    s.update_from_output(out, runner.execute(out))  # a and b reach max_tokens=2
    out = s.schedule()
    assert out.num_scheduled_tokens == {"c": 4}
    assert out.finished_req_ids == {"a", "b"}


def test_fcfs_ignores_priority() -> None:
    assert admission_order(make_scheduler(max_num_seqs=1), mixed_priorities()) == [
        "x", "y", "z", "w"]


def test_priority_admits_lower_value_first_then_earlier_arrival() -> None:
    s = make_scheduler(max_num_seqs=1, policy="priority")
    assert admission_order(s, mixed_priorities()) == ["z", "y", "w", "x"]


def three_one_page_requests() -> list[EngineRequest]:
    # Admitted in this order; each prompt fills exactly one page of 4 tokens.
    return [
        make_request("low", [1, 2, 3, 4], 6, priority=9, arrival=0.0, ignore_eos=True),
        make_request("high", [5, 6, 7, 8], 6, priority=0, arrival=1.0, ignore_eos=True),
        make_request("mid", [9, 10, 11, 12], 6, priority=5, arrival=2.0, ignore_eos=True),
    ]


@pytest.mark.parametrize(("policy", "victim"), [("priority", "low"), ("fcfs", "mid")])
def test_preemption_victim_and_resumption(policy: str, victim: str) -> None:
    # 4 usable pages: three prompts take one each, and the second decode step
    # needs a new page per request, so exactly one request must be evicted.
    s = make_scheduler(num_pages=5, policy=policy)
    requests = three_one_page_requests()
    for r in requests:
        s.add_request(r)
    runner = FakeRunner(4)
    got = Collected()
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"low", "high", "mid"}
    got.add(s.update_from_output(out, runner.execute(out)))
    out = s.schedule()
    assert out.preempted_req_ids == {victim}
    assert set(out.num_scheduled_tokens) == {"low", "high", "mid"} - {victim}
    evicted = next(r for r in requests if r.request_id == victim)
    assert evicted.status is EngineRequestStatus.PREEMPTED
    assert (evicted.num_computed_tokens, evicted.num_preemptions) == (0, 1)
    got.add(s.update_from_output(out, runner.execute(out)))
    run(s, runner, collected=got)
    for r in requests:
        assert got.tokens[r.request_id] == reference_output(r.prompt_token_ids, 6)
    assert s.kv_cache_manager.num_free_pages == s.kv_cache_manager.num_usable_pages


def test_priority_running_list_is_scheduled_in_priority_order() -> None:
    s = make_scheduler(policy="priority")
    for r in three_one_page_requests():
        s.add_request(r)
    runner = FakeRunner(4)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    assert [r.request_id for r in s.running] == ["high", "mid", "low"]
    out = s.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("high", 1), ("mid", 1), ("low", 1)]


@pytest.mark.parametrize(("count", "buckets", "expected_running", "expected_bucket"), [
    (6, [2, 4], 4, 4), (3, [2, 4], 3, 4), (1, [2, 4], 1, 2),
    (5, None, 5, 6), (3, None, 3, 4), (1, None, 1, 1), (2, None, 2, 2),
])
def test_seq_bucket_selection(count: int, buckets: list[int] | None, expected_running: int,
                              expected_bucket: int) -> None:
    s = make_scheduler(max_num_seqs=6, seq_buckets=buckets)
    for i in range(count):
        s.add_request(make_request(f"r{i}", 2, 4))
    out = s.schedule()
    assert len(out.num_scheduled_tokens) == expected_running
    assert s.get_request_counts() == (expected_running, count - expected_running)
    assert out.num_seq_bucket == expected_bucket


def test_config_buckets_apply_and_constructor_buckets_override() -> None:
    s = make_scheduler(max_num_seqs=8, buckets=(1, 3))
    for i in range(5):
        s.add_request(make_request(f"r{i}", 2, 4))
    out = s.schedule()
    assert (len(out.num_scheduled_tokens), out.num_seq_bucket) == (3, 3)
    s2 = make_scheduler(max_num_seqs=8, buckets=(1, 3), seq_buckets=[2, 5])
    for i in range(5):
        s2.add_request(make_request(f"r{i}", 2, 4))
    out = s2.schedule()
    assert (len(out.num_scheduled_tokens), out.num_seq_bucket) == (5, 5)


@pytest.mark.parametrize("buckets", [[4, 2], [0, 2], [2, 16], [], [2, 2]])
def test_bad_buckets_are_refused(buckets: list[int]) -> None:
    with pytest.raises(ValueError, match="max_num_seq_buckets"):
        make_scheduler(max_num_seqs=8, seq_buckets=buckets)


@pytest.mark.parametrize(("margin", "admitted"), [(None, ["a", "b", "c"]), (8, ["a", "b"])])
def test_token_safety_margin_keeps_pages_in_reserve(margin: int | None,
                                                    admitted: list[str]) -> None:
    # 6 usable pages of 4; each prompt of 8 takes 2. A margin of 8 tokens keeps
    # 2 pages per running request free: with a and b running, c would leave 0 < 4.
    s = make_scheduler(num_pages=7, margin=margin)
    for k, rid in enumerate("abc"):
        s.add_request(make_request(rid, [10 * k + t for t in range(8)], 4))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == admitted
    assert s.kv_cache_manager.num_free_pages == 6 - 2 * len(admitted)


@pytest.mark.parametrize(("policy", "victim", "scheduled"), [
    ("priority", "low", {"high": 1}), ("fcfs", "high", {"low": 1})])
def test_a_later_high_priority_request_runs_ahead_of_earlier_low_ones(
        policy: str, victim: str, scheduled: dict[str, int]) -> None:
    # 3 usable pages: low (1 page) decodes into a second page while high takes
    # the third; then high needs a second page and someone must go.
    s = make_scheduler(num_pages=4, policy=policy)
    low = make_request("low", [1, 2, 3, 4], 4, priority=5, arrival=0.0, ignore_eos=True)
    high = make_request("high", [5, 6, 7, 8], 4, priority=0, arrival=1.0, ignore_eos=True)
    runner = FakeRunner(4)
    got = Collected()
    s.add_request(low)
    out = s.schedule()
    got.add(s.update_from_output(out, runner.execute(out)))
    s.add_request(high)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"low": 1, "high": 4}
    got.add(s.update_from_output(out, runner.execute(out)))
    out = s.schedule()
    assert (out.preempted_req_ids, out.num_scheduled_tokens) == ({victim}, scheduled)
    got.add(s.update_from_output(out, runner.execute(out)))
    run(s, runner, collected=got)
    assert got.tokens["low"] == reference_output([1, 2, 3, 4], 4)
    assert got.tokens["high"] == reference_output([5, 6, 7, 8], 4)


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    # 4 usable pages. After two steps a holds 2 and b holds 2; b then needs a
    # third, is evicted (lowest priority) and frees 2 pages. c outranks b and
    # would fit, but waits a step so the freed pages are not fought over.
    s = make_scheduler(num_pages=5, policy="priority")
    a = make_request("a", [1, 2, 3, 4], 8, priority=0, ignore_eos=True)
    b = make_request("b", [9, 8, 7, 6, 5, 4, 3], 8, priority=2, ignore_eos=True)
    c = make_request("c", [20, 21, 22, 23], 8, priority=1, arrival=5.0, ignore_eos=True)
    runner = FakeRunner(4)
    got = Collected()
    for r in (a, b):
        s.add_request(r)
    plans = []
    for _ in range(2):
        out = s.schedule()
        plans.append(out.num_scheduled_tokens)
        got.add(s.update_from_output(out, runner.execute(out)))
    s.add_request(c)
    out = s.schedule()
    plans.append(out.num_scheduled_tokens)
    assert out.preempted_req_ids == {"b"} and out.scheduled_new_reqs == []
    assert s.kv_cache_manager.num_free_pages == 2
    got.add(s.update_from_output(out, runner.execute(out)))
    out = s.schedule()
    plans.append(out.num_scheduled_tokens)
    got.add(s.update_from_output(out, runner.execute(out)))
    assert plans == [{"a": 4, "b": 7}, {"a": 1, "b": 1}, {"a": 1}, {"a": 1, "c": 4}]
    run(s, runner, collected=got)
    for r in (a, b, c):
        assert got.tokens[r.request_id] == reference_output(r.prompt_token_ids, 8)
