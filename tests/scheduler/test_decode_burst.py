"""Decode bursts: when the scheduler takes them, and that they change no output."""

from __future__ import annotations

import pytest

from esurge.engine_types import FinishReason
from esurge.errors import InvalidConfigError
from esurge.outputs import ModelRunnerOutput
from tests.scheduler.fakes import (
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
    run,
)

PROMPTS = [[(7 * k + t) % 40 + 1 for t in range(3 + 2 * k)] for k in range(6)]


def _decode_all(s, runner: FakeRunner) -> None:
    """Run plain steps until every request has its prompt computed."""
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running) or s.waiting:
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("steps", "num_pages"), [(4, 200), (3, 200), (4, 20)])
def test_bursts_give_the_reference_tokens_and_free_every_page(
        async_scheduling: bool, steps: int, num_pages: int) -> None:
    s = make_scheduler(async_scheduling=async_scheduling, decode_steps=steps,
                       num_pages=num_pages, max_num_batched_tokens=64)
    max_tokens = [11, 4, 9, 1, 13, 6]
    for k, p in enumerate(PROMPTS):
        s.add_request(make_request(f"r{k}", p, max_tokens[k], ignore_eos=True,
                                    temperature=0.0))
    runner = FakeRunner(4)
    got = run(s, runner)
    for k, p in enumerate(PROMPTS):
        assert got.tokens[f"r{k}"] == reference_output(p, max_tokens[k])
        assert got.reason(f"r{k}") is FinishReason.LENGTH
    kv = s.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)
    if num_pages == 200:  # room for bursts: fewer steps than one per token
        assert runner.steps < max(max_tokens) + 2


def test_a_burst_schedules_k_tokens_per_request_and_k_placeholders() -> None:
    s = make_scheduler(async_scheduling=True, decode_steps=4)
    a = make_request("a", [1, 2, 3, 4, 5], 20, ignore_eos=True, temperature=0.0)
    b = make_request("b", [6, 7], 20, ignore_eos=True, temperature=0.0)
    for r in (a, b):
        s.add_request(r)
    runner = FakeRunner(4)
    first = s.schedule()  # prompts: a plain step
    assert first.num_decode_steps == 1
    res1 = runner.execute(first)
    burst = s.schedule()  # both decode, nobody waits
    assert burst.num_decode_steps == 4
    assert burst.num_scheduled_tokens == {"a": 4, "b": 4}
    assert burst.total_num_scheduled_tokens == 8
    assert burst.scheduled_cached_reqs.num_computed_tokens == [5, 2]
    assert (a.num_output_placeholders, b.num_output_placeholders) == (5, 5)
    res2 = runner.execute(burst)
    s.update_from_output(first, res1)
    s.update_from_output(burst, res2)
    assert a.output_token_ids == reference_output([1, 2, 3, 4, 5], 5)
    assert b.output_token_ids == reference_output([6, 7], 5)
    # The burst's positions 5..8 (a) have pages: 9 positions -> 3 pages of 4.
    assert len(s.kv_cache_manager.get_pages("a").page_ids[0]) == 3


def test_no_burst_while_a_request_could_be_admitted_or_prefills() -> None:
    # 4 usable pages of 4 tokens: a (12-token prompt) holds 3, so b waits for
    # pages though a slot is free; a burst would keep it out longer.
    s = make_scheduler(decode_steps=4, num_pages=5, max_num_batched_tokens=64,
                       max_model_len=16)
    s.add_request(make_request("a", 12, 4, ignore_eos=True, temperature=0.0))
    s.add_request(make_request("b", [4, 5, 6, 7, 8, 9, 10], 9, ignore_eos=True,
                               temperature=0.0))
    runner = FakeRunner(4)
    seen = []
    while s.has_requests():
        waiting = len(s.waiting)
        out = s.schedule()
        if out.num_scheduled_tokens:
            seen.append((waiting > 0, out.num_decode_steps))
        s.update_from_output(out, runner.execute(out))
    assert (True, 1) in seen and (True, 4) not in seen
    assert (False, 4) in seen  # b alone, nobody waiting: bursts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_full_batch_bursts_until_a_request_nears_its_end(async_scheduling: bool) -> None:
    s = make_scheduler(decode_steps=4, max_num_seqs=2, max_num_batched_tokens=64,
                       async_scheduling=async_scheduling)
    lengths = {"a": 14, "b": 9, "c": 6}
    for rid, n in lengths.items():
        s.add_request(make_request(rid, [ord(rid), 2, 3], n, ignore_eos=True, temperature=0.0))
    runner = FakeRunner(4)
    waiting_at_bursts = []
    schedule = s.schedule

    def recording_schedule():  # notes whether c was waiting at each burst
        waiting = len(s.waiting)
        out = schedule()
        if out.num_decode_steps > 1:
            waiting_at_bursts.append(waiting)
        return out

    s.schedule = recording_schedule  # type: ignore[method-assign]
    got = run(s, runner)
    for rid, n in lengths.items():
        assert got.tokens[rid] == reference_output([ord(rid), 2, 3], n)
    assert 1 in waiting_at_bursts  # bursts while c waited for a slot
    kv = s.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


def test_no_burst_while_a_running_request_would_end_inside_it_and_others_wait() -> None:
    s = make_scheduler(decode_steps=4, max_num_seqs=1, max_num_batched_tokens=64)
    s.add_request(make_request("a", [1, 2, 3], 3, ignore_eos=True, temperature=0.0))
    s.add_request(make_request("b", [4, 5, 6], 10, ignore_eos=True, temperature=0.0))
    runner = FakeRunner(4)
    out = s.schedule()  # a's prompt; b waits for the only slot
    s.update_from_output(out, runner.execute(out))
    out = s.schedule()  # a has 2 tokens left: a burst would keep b out for 2 iterations
    assert out.num_decode_steps == 1 and list(out.num_scheduled_tokens) == ["a"]


@pytest.mark.parametrize("params", [
    {"temperature": 0.0, "logprobs": 2},
    {"temperature": 0.7, "repetition_penalty": 1.2},
    {"temperature": 0.0, "presence_penalty": 0.5},
    {"temperature": 0.0, "logit_bias": {3: 1.0}},
    {"temperature": 0.0, "min_tokens": 2},
])
def test_no_burst_when_sampling_keeps_per_token_state(params: dict[str, object]) -> None:
    s = make_scheduler(decode_steps=4)
    s.add_request(make_request("plain", [1, 2, 3], 10, ignore_eos=True, temperature=0.0))
    s.add_request(make_request("other", [4, 5], 10, ignore_eos=True, **params))
    runner = FakeRunner(4)
    _decode_all(s, runner)
    for _ in range(3):
        out = s.schedule()
        assert out.num_decode_steps == 1
        s.update_from_output(out, runner.execute(out))


def test_sampled_requests_take_bursts() -> None:
    s = make_scheduler(decode_steps=4)
    s.add_request(make_request("greedy", [1, 2, 3], 10, ignore_eos=True, temperature=0.0))
    s.add_request(make_request("sampled", [4, 5], 10, ignore_eos=True, temperature=0.8,
                               top_p=0.9, top_k=5, seed=7))
    runner = FakeRunner(4)
    _decode_all(s, runner)
    assert s.schedule().num_decode_steps == 4


def test_no_burst_near_max_model_len_or_without_free_pages() -> None:
    s = make_scheduler(decode_steps=4, max_model_len=12, max_num_batched_tokens=12)
    s.add_request(make_request("a", 6, None, ignore_eos=True, temperature=0.0))
    runner = FakeRunner(4)
    seen = []
    while s.has_requests():
        out = s.schedule()
        if out.num_scheduled_tokens:
            seen.append((out.num_decode_steps, out.scheduled_cached_reqs.num_computed_tokens))
        s.update_from_output(out, runner.execute(out))
    # Positions 6..9 go as one burst; 10 cannot (its burst would pass position 11).
    assert seen == [(1, []), (4, [6]), (1, [10])]

    # 8 positions can span 2 new pages of 4; with 1 free page the burst could
    # preempt where plain steps would not, so it is not taken.
    tight = make_scheduler(decode_steps=8, num_pages=3, max_model_len=32)  # 2 usable pages
    tight.add_request(make_request("a", 3, 5, ignore_eos=True, temperature=0.0))
    runner = FakeRunner(4)
    out = tight.schedule()
    tight.update_from_output(out, runner.execute(out))
    assert tight.kv_cache_manager.num_free_pages == 1
    got = run(tight, runner)
    assert got.tokens["a"] == reference_output([1, 2, 3], 5)[1:]
    # Plain steps only: the prompt, one per remaining token, one reporting the end.
    assert runner.steps == 1 + 4 + 1


def test_a_stop_inside_a_burst_keeps_the_tokens_up_to_it() -> None:
    prompt = [3, 1, 4, 1, 5]
    ref = reference_output(prompt, 12)
    stop = ref[5]
    s = make_scheduler(decode_steps=4)
    s.add_request(make_request("a", prompt, 12, stop_token_ids=(stop,), temperature=0.0))
    got = run(s)
    assert got.tokens["a"] == ref[:ref.index(stop) + 1]
    assert got.reason("a") is FinishReason.STOP
    kv = s.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


def test_more_tokens_than_the_burst_is_an_error() -> None:
    s = make_scheduler(decode_steps=2)
    s.add_request(make_request("a", [1, 2], 10, ignore_eos=True, temperature=0.0))
    runner = FakeRunner(4)
    _decode_all(s, runner)
    out = s.schedule()
    assert out.num_decode_steps == 2
    bad = ModelRunnerOutput(["a"], {"a": 0}, [[1, 2, 3]])
    with pytest.raises(ValueError, match="3 sampled tokens"):
        s.update_from_output(out, bad)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_decode_steps_is_validated(bad: object) -> None:
    with pytest.raises(InvalidConfigError) as info:
        make_scheduler(decode_steps=bad)  # type: ignore[arg-type]
    assert info.value.field == "decode_steps"


def test_bursts_with_speculation_are_refused() -> None:
    with pytest.raises(InvalidConfigError, match="decode_steps=4 with speculative decoding"
                       ) as info:
        make_scheduler(decode_steps=4, num_spec=2)
    assert info.value.field == "decode_steps"
