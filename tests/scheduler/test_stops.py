"""Stop conditions in update_from_output, and logprobs pass-through."""

from __future__ import annotations

from esurge.engine_types import FinishReason
from esurge.outputs import ModelRunnerOutput, TokenLogprobs
from esurge.scheduler import SchedulerOutput
from tests.scheduler.fakes import (
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
    run,
)

PROMPT = [3, 1, 4, 1, 5]
REF = reference_output(PROMPT, 12)


def first_new_at(index: int) -> int:
    """A token of REF that first appears at position index."""
    assert REF[index] not in REF[:index]
    return REF[index]


def one_run(max_model_len: int = 64, **kw: object) -> tuple[list[int], object, object]:
    s = make_scheduler(max_model_len=max_model_len, max_num_batched_tokens=max_model_len)
    s.add_request(make_request("a", PROMPT, **kw))  # type: ignore[arg-type]
    got = run(s)
    final = got.finals["a"][0]
    assert len(got.finals["a"]) == 1
    assert s.kv_cache_manager.num_free_pages == s.kv_cache_manager.num_usable_pages
    return got.tokens["a"], final.finish_reason, final.stop_reason


def test_max_tokens_caps_the_length() -> None:
    assert one_run(max_tokens=7) == (REF[:7], FinishReason.LENGTH, None)


def test_eos_stops_and_stays_in_the_output() -> None:
    eos = first_new_at(3)
    assert one_run(max_tokens=12, eos=eos) == (REF[:4], FinishReason.STOP, None)


def test_ignore_eos_runs_to_max_tokens() -> None:
    eos = first_new_at(3)
    assert one_run(max_tokens=12, eos=eos, ignore_eos=True) == (REF, FinishReason.LENGTH, None)


def test_stop_token_ids_stop_with_the_token_as_reason() -> None:
    stop = first_new_at(2)
    assert one_run(max_tokens=12, stop_token_ids=(stop,)) == (REF[:3], FinishReason.STOP, stop)


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    eos = first_new_at(1)
    expected = reference_output(PROMPT, 12, eos=eos, min_tokens=4)
    assert len(expected) > 4  # the early EOS really was skipped
    tokens, reason, _ = one_run(max_tokens=12, eos=eos, min_tokens=4)
    assert tokens == expected
    assert reason is (FinishReason.STOP if expected[-1] == eos and len(expected) < 12
                      else FinishReason.LENGTH)


def test_stop_token_on_the_last_allowed_token_reports_stop() -> None:
    stop = first_new_at(3)
    assert one_run(max_tokens=4, stop_token_ids=(stop,)) == (REF[:4], FinishReason.STOP, stop)


def test_max_model_len_caps_when_max_tokens_is_none() -> None:
    s = make_scheduler(max_model_len=16, max_num_batched_tokens=16)
    s.add_request(make_request("a", PROMPT, None))
    runner = FakeRunner(4)
    got = Collected()
    ends: list[int] = []
    while s.has_requests():
        out = s.schedule()
        ends.extend(n.num_computed_tokens + out.num_scheduled_tokens[n.req_id]
                    for n in out.scheduled_new_reqs)
        cached = out.scheduled_cached_reqs
        ends.extend(c + out.num_scheduled_tokens[r]
                    for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        got.add(s.update_from_output(out, runner.execute(out)))
    assert max(ends) == 15  # position 15 is never fed: its token would be the 17th
    assert got.tokens["a"] == reference_output(PROMPT, 11)
    assert got.reason("a") is FinishReason.LENGTH


def spec_step(req: str, out: SchedulerOutput, sampled: list[int],
              drafts: list[int] | None = None,
              logprobs: list[TokenLogprobs] | None = None) -> ModelRunnerOutput:
    assert list(out.num_scheduled_tokens) == [req]
    return ModelRunnerOutput([req], {req: 0}, [sampled],
                             [drafts or []] if drafts is not None else None,
                             [logprobs] if logprobs is not None else None)


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs((token, 0), (-0.5, -1.5), 1)


def test_stop_among_accepted_drafts_drops_later_tokens_and_logprobs() -> None:
    s = make_scheduler(num_spec=2)
    s.add_request(make_request("a", [1, 2, 3, 4], 10, stop_token_ids=(7,), logprobs=1))
    out = s.schedule()
    s.update_from_output(out, spec_step("a", out, [5], [6, 7], [lp(5)]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.scheduled_spec_decode_tokens == {"a": [6, 7]}
    result = s.update_from_output(out, spec_step("a", out, [6, 7, 9], [1, 1],
                                                 [lp(6), lp(7), lp(9)]))
    (o,) = result[0].outputs
    assert (o.new_token_ids, o.finish_reason, o.stop_reason) == ([6, 7], FinishReason.STOP, 7)
    assert o.new_logprobs == [lp(6), lp(7)]
    assert (o.num_draft_tokens, o.num_accepted_tokens) == (2, 2)
    assert s.kv_cache_manager.usage == 0.0


def test_logprobs_and_prompt_logprobs_pass_through() -> None:
    s = make_scheduler(chunked=True, max_num_batched_tokens=4)
    s.add_request(make_request("a", [1, 2, 3, 4, 5, 6], 2, logprobs=1, prompt_logprobs=1,
                               ignore_eos=True))
    out = s.schedule()
    chunk1 = [None, lp(2), lp(3), lp(4)]
    result = s.update_from_output(out, ModelRunnerOutput(["a"], {"a": 0}, [[]], None, [None],
                                                         {"a": chunk1}))
    (o,) = result[0].outputs
    assert (o.new_token_ids, o.new_prompt_logprobs, o.finished) == ([], chunk1, False)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 2}
    result = s.update_from_output(out, ModelRunnerOutput(["a"], {"a": 0}, [[8]], None,
                                                         [[lp(8)]], {"a": [lp(5), lp(6)]}))
    (o,) = result[0].outputs
    assert (o.new_token_ids, o.new_logprobs, o.new_prompt_logprobs) == (
        [8], [lp(8)], [lp(5), lp(6)])


def test_fake_runner_logprobs_follow_the_tokens() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT, 5, logprobs=0, ignore_eos=True))
    got = run(s)
    assert got.tokens["a"] == REF[:5]
    flat = [x.token_ids[0] for o in got.outputs["a"] for x in o.new_logprobs or ()]
    assert flat == REF[:5]
