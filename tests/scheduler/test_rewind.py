"""Scheduler.rewind: a running request computes again from an earlier position
(its draft head missed those tokens); its pages stay and its tokens do not change."""

from __future__ import annotations

from tests.scheduler.fakes import (
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
    run,
)


def test_a_rewound_request_computes_the_span_again_in_one_chunk() -> None:
    s = make_scheduler(page_size=4, num_pages=32)
    s.add_request(make_request("a", [3, 1, 4, 1, 5], 20, ignore_eos=True))
    s.add_request(make_request("b", [2, 7, 1], 20, ignore_eos=True))
    runner, got = FakeRunner(4), Collected()
    for _ in range(6):  # the prompts, then five decode steps
        out = s.schedule()
        got.add(s.update_from_output(out, runner.execute(out)))
    a = s.requests["a"]
    computed, pages = a.num_computed_tokens, s.kv_cache_manager.num_free_pages
    assert computed == 10 and len(a.all_token_ids) == 11
    assert s.rewind({"a": 6, "b": 4, "gone": 1}) == {"a": 10, "b": 8}
    runner.states["a"].computed, runner.states["b"].computed = 6, 4  # the runner's own
    out = s.schedule()
    # Everything from the rewound position to the last known token, one chunk;
    # the pages are those a decode step would hold (b's last token opens one).
    assert out.num_scheduled_tokens == {"a": 5, "b": 5}
    held = {rid: len(s.kv_cache_manager.get_pages(rid).page_ids[0]) for rid in "ab"}
    assert held == {"a": 3, "b": 3} and s.kv_cache_manager.num_free_pages == pages - 1
    got.add(s.update_from_output(out, runner.execute(out)))
    run(s, runner, collected=got)
    assert got.tokens["a"] == reference_output([3, 1, 4, 1, 5], 20)
    assert got.tokens["b"] == reference_output([2, 7, 1], 20)
    kv = s.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)


def test_only_a_running_request_with_nothing_in_flight_moves_back() -> None:
    s = make_scheduler(async_scheduling=True, max_num_seqs=1)
    s.add_request(make_request("a", [1, 2, 3, 4], 8, ignore_eos=True))
    s.add_request(make_request("w", [5, 6], 8, ignore_eos=True))  # waits: one seat
    runner = FakeRunner(4)
    out = s.schedule()
    result = runner.execute(out)
    s.update_from_output(out, result)
    out = s.schedule()  # a step in flight: its token is a placeholder
    assert s.requests["a"].num_output_placeholders == 1
    assert s.rewind({"a": 2, "w": 0}) == {}
    s.update_from_output(out, runner.execute(out))
    a = s.requests["a"]
    # Nothing in flight now; the position must lie before what is computed.
    assert s.rewind({"a": a.num_computed_tokens}) == {} and s.rewind({"a": -1}) == {}
    a.spec_token_ids = [9]  # drafts waiting to be verified would be stale
    assert s.rewind({"a": 2}) == {}
    a.spec_token_ids = []
    computed = a.num_computed_tokens
    assert s.rewind({"a": 2}) == {"a": computed} and a.num_computed_tokens == 2
