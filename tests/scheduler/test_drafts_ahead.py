"""Speculative steps that hand their drafts to the next step at dispatch.

Under async scheduling a runner whose step of decoding requests proposes
drafts for every one of them gives those drafts to the scheduler before the
step is read (`Scheduler.take_drafts`): the next step is scheduled to verify
them as if every draft in flight were accepted, the runner moves each
request back over the drafts that step rejected, and the step's update rolls
the scheduler's count back the same way. The tokens must be the ones a
synchronous engine outputs, with every page and placeholder returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pytest

from esurge.engine.core import EngineCore
from esurge.engine_types import FinishReason
from esurge.outputs import ModelRunnerOutput
from esurge.scheduler import SchedulerOutput
from tests.scheduler.fakes import (
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
)

PROMPTS = [[(7 * k + t) % 30 + 1 for t in range(3 + 2 * k)] for k in range(6)]

Pending = tuple[SchedulerOutput, ModelRunnerOutput]


@dataclass
class _AheadExecutor:
    """FakeRunner steps, run at dispatch; a step in which every request sampled
    and proposed drafts hands them ahead and pipelines, any other step with
    drafts is collected before the next is scheduled."""

    runner: FakeRunner

    def dispatch(self, out: SchedulerOutput) -> Pending:
        result = self.runner.execute(out)
        verified = out.scheduled_spec_decode_tokens
        self.runner.moved_back = {
            rid: len(verified[rid]) - (len(result.sampled_token_ids[i]) - 1)
            for i, rid in enumerate(result.req_ids)
            if rid in verified and result.sampled_token_ids[i]
        } if self.drafts_ahead((out, result)) else {}
        return out, result

    def collect(self, pending: Pending) -> ModelRunnerOutput:
        return pending[1]

    def pipelines(self, pending: Pending) -> bool:
        out, result = pending
        return bool(self.drafts_ahead(pending)) or not (
            out.scheduled_spec_decode_tokens or any(result.spec_token_ids or []))

    def drafts_ahead(self, pending: Pending) -> dict[str, list[int]]:
        _, result = pending
        proposals = result.spec_token_ids or []
        if not proposals or not all(result.sampled_token_ids) or not all(proposals):
            return {}
        return {rid: list(proposals[i]) for i, rid in enumerate(result.req_ids)}

    def resyncs(self) -> dict[str, int]:
        return {}

    def rewound(self, computed: Mapping[str, int]) -> None:
        pass


def _drive(core: EngineCore[Pending]) -> Collected:
    got = Collected()
    for _ in range(800):
        if not core.has_work():
            return got
        got.add(core.step())
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("num_pages", [200, 16])
def test_steps_that_hand_drafts_ahead_give_the_synchronous_tokens(num_pages: int) -> None:
    s = make_scheduler(async_scheduling=True, num_spec=3, num_pages=num_pages, max_model_len=40,
                       max_num_batched_tokens=40)
    # Mixed lengths, one stopping at a token of its own output: tokens sampled
    # past a stop or past max_tokens by a step already in flight are dropped.
    eos = reference_output(PROMPTS[1], 9)[5]
    for k, p in enumerate(PROMPTS):
        s.add_request(make_request(f"r{k}", p, 9 + 3 * k, eos=eos if k == 1 else None,
                                   ignore_eos=k != 1))
    core = EngineCore(s, _AheadExecutor(FakeRunner(4, drafts=3)), async_scheduling=True)
    got = _drive(core)
    for k, p in enumerate(PROMPTS):
        want = reference_output(p, 9 + 3 * k, eos=eos if k == 1 else None)
        assert got.tokens[f"r{k}"] == want
        assert got.reason(f"r{k}") is (FinishReason.STOP if k == 1 else FinishReason.LENGTH)
    assert core.num_drafts_ahead > 5 and core.num_overlapped_steps >= core.num_drafts_ahead
    assert sum(o.num_accepted_tokens for k in range(len(PROMPTS))
               for o in got.outputs[f"r{k}"]) > 0
    if num_pages == 16:
        assert s.num_preemptions > 0
    kv = s.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)
    assert not s.requests


def test_a_step_scheduled_ahead_verifies_the_drafts_and_its_update_rolls_back() -> None:
    s = make_scheduler(async_scheduling=True, num_spec=3, page_size=4)
    a = make_request("a", [1, 2, 3, 4], 20, ignore_eos=True)
    s.add_request(a)
    s.update_from_output(s.schedule(), ModelRunnerOutput(["a"], {"a": 0}, [[10]], [[11, 12, 13]]))
    first = s.schedule()  # verifies 11, 12, 13 at positions 5-7 after 10 at 4
    assert (a.num_computed_tokens, a.num_output_placeholders) == (8, 4)
    with pytest.raises(ValueError, match="draft tokens"):
        s.schedule()
    s.take_drafts({"a": [21, 22, 23]})  # proposed by `first`, before it is read
    second = s.schedule()
    assert second.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    assert second.num_scheduled_tokens == {"a": 4}
    assert second.scheduled_cached_reqs.num_computed_tokens == [8]  # as if all were accepted
    assert (a.num_computed_tokens, a.num_output_placeholders) == (12, 8)
    # `first` accepted 11 only: 12 and 13 were rejected, so `second` ran two
    # positions back (the runner's move); the count follows.
    s.update_from_output(first, ModelRunnerOutput(["a"], {"a": 0}, [[11, 30]], [[31]]))
    assert (a.num_computed_tokens, a.num_output_placeholders, a.spec_token_ids) == (10, 4, [])
    s.update_from_output(second, ModelRunnerOutput(["a"], {"a": 0}, [[21, 22, 40]], [[41]]))
    assert (a.num_computed_tokens, a.num_output_placeholders) == (9, 0)  # all but the last
    assert a.output_token_ids == [10, 11, 30, 21, 22, 40]
    assert a.spec_token_ids == [41]


def test_a_request_whose_drafts_stop_drops_the_drafts_handed_ahead() -> None:
    s = make_scheduler(async_scheduling=True, num_spec=2, page_size=4)
    a = make_request("a", [1, 2, 3, 4], 20, ignore_eos=True)
    s.add_request(a)
    s.update_from_output(s.schedule(), ModelRunnerOutput(["a"], {"a": 0}, [[10]], [[11, 12]]))
    first = s.schedule()
    s.take_drafts({"a": [21, 22]})
    second = s.schedule()
    s.take_drafts({"a": [31, 32]})  # `second`'s, proposed before `first` was read
    # `first`'s verification stopped the request's drafts (no proposal): the
    # step after `second` verifies none.
    s.update_from_output(first, ModelRunnerOutput(["a"], {"a": 0}, [[11, 12, 20]], [[]]))
    assert a.spec_token_ids == []
    s.update_from_output(second, ModelRunnerOutput(["a"], {"a": 0}, [[21, 30]], [[]]))
    third = s.schedule()
    assert (third.num_scheduled_tokens, third.scheduled_spec_decode_tokens) == ({"a": 1}, {})
    assert a.output_token_ids == [10, 11, 12, 20, 21, 30]


def test_drafts_ahead_need_async_scheduling() -> None:
    s = make_scheduler(num_spec=3)
    with pytest.raises(ValueError, match="async_scheduling"):
        s.take_drafts({"a": [1]})
