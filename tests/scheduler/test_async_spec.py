"""Async scheduling placeholders and speculative-token verification with rollback."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
    run,
)

PROMPTS = [[(5 * k + t) % 30 + 1 for t in range(4 + k)] for k in range(5)]


def test_async_placeholders_track_tokens_in_flight() -> None:
    s = make_scheduler(async_scheduling=True)
    a = make_request("a", [1, 2, 3, 4], 8, ignore_eos=True)
    s.add_request(a)
    runner = FakeRunner(4)
    out1 = s.schedule()
    res1 = runner.execute(out1)
    assert (out1.num_scheduled_tokens, a.num_output_placeholders) == ({"a": 4}, 1)
    out2 = s.schedule()  # before step 1's token is known
    res2 = runner.execute(out2)
    assert out2.num_scheduled_tokens == {"a": 1}
    assert out2.scheduled_cached_reqs.num_computed_tokens == [4]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (5, 2)
    first = s.update_from_output(out1, res1)[0].outputs[0].new_token_ids
    assert first == reference_output([1, 2, 3, 4], 1)
    assert (a.num_output_placeholders, a.num_tokens) == (1, 5)
    out3 = s.schedule()
    assert out3.num_scheduled_tokens == {"a": 1}
    assert out3.scheduled_cached_reqs.num_computed_tokens == [5]
    s.update_from_output(out2, res2)
    assert a.output_token_ids == reference_output([1, 2, 3, 4], 2)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("num_pages", [200, 12])
def test_async_gives_the_same_tokens_as_sync(chunked: bool, num_pages: int) -> None:
    runs = []
    for async_scheduling in (False, True):
        s = make_scheduler(async_scheduling=async_scheduling, chunked=chunked,
                           max_num_batched_tokens=6 if chunked else 64, num_pages=num_pages)
        for k, p in enumerate(PROMPTS):
            s.add_request(make_request(f"r{k}", p, 7, ignore_eos=True))
        runs.append(run(s))
        kv = s.kv_cache_manager
        assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)
    sync_run, async_run = runs
    for k, p in enumerate(PROMPTS):
        assert async_run.tokens[f"r{k}"] == sync_run.tokens[f"r{k}"] == reference_output(p, 7)
        assert async_run.reason(f"r{k}") is FinishReason.LENGTH


def test_async_drops_the_extra_token_of_a_late_stop() -> None:
    prompt = [2, 7, 1, 8]
    ref = reference_output(prompt, 10)
    eos = ref[2]
    assert eos not in ref[:2]
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", prompt, 10, eos=eos))
    runner = FakeRunner(4)
    got = run(s, runner)
    assert got.tokens["a"] == ref[:3]
    assert got.reason("a") is FinishReason.STOP
    assert runner.steps == 5  # prefill, 2 decodes, the wasted one, the finished-ids step


def test_async_does_not_schedule_past_max_tokens() -> None:
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", [1, 2, 3], 1))
    runner = FakeRunner(4)
    out1 = s.schedule()
    res1 = runner.execute(out1)
    assert s.schedule().num_scheduled_tokens == {}  # its only token is already on its way
    result = s.update_from_output(out1, res1)
    assert result[0].outputs[0].finish_reason is FinishReason.LENGTH


def test_async_verification_releases_a_placeholder_per_draft() -> None:
    s = make_scheduler(async_scheduling=True, num_spec=3, page_size=4)
    a = make_request("a", [1, 2, 3, 4], 20, ignore_eos=True)
    s.add_request(a)
    out = s.schedule()
    assert a.num_output_placeholders == 1
    s.update_from_output(out, runner_output("a", [10], [11, 12, 13]))
    assert (a.num_output_placeholders, a.spec_token_ids) == (0, [11, 12, 13])
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert a.num_output_placeholders == 4  # the sampled token and one per draft
    s.update_from_output(out, runner_output("a", [11, 20], [21]))
    assert (a.num_output_placeholders, a.num_computed_tokens, a.spec_token_ids) == (0, 6, [21])
    out = s.schedule()
    assert (out.num_scheduled_tokens, out.scheduled_spec_decode_tokens) == ({"a": 2}, {"a": [21]})


def test_nothing_is_scheduled_behind_a_step_that_verifies_drafts() -> None:
    s = make_scheduler(async_scheduling=True, num_spec=2)
    s.add_request(make_request("a", [1, 2, 3, 4], 20, ignore_eos=True))
    s.add_request(make_request("b", [5, 6, 7], 20, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[10], [20]],
                                                [[11, 12], []]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12]}
    with pytest.raises(ValueError, match="draft tokens"):
        s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1},
                                                [[11, 30], [21]], [[], []]))
    s.schedule()  # a step without drafts may have the next one behind it
    s.schedule()


def test_async_drops_drafts_that_arrive_behind_a_scheduled_step() -> None:
    # Driven without a barrier, every step's drafts arrive once the next step
    # is already scheduled: they are dropped and the tokens stay exact.
    s = make_scheduler(async_scheduling=True, num_spec=3, max_model_len=32,
                       max_num_batched_tokens=32)
    for k, p in enumerate(PROMPTS):
        s.add_request(make_request(f"r{k}", p, 12, ignore_eos=True))
    got = run(s, FakeRunner(4, drafts=3))
    for k, p in enumerate(PROMPTS):
        assert got.tokens[f"r{k}"] == reference_output(p, 12)
        assert sum(o.num_draft_tokens for o in got.outputs[f"r{k}"]) == 0
    kv = s.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages


@dataclass
class _MixedExecutor:
    """An executor over FakeRunner whose steps propose drafts only on every third
    step: the others pipeline (async scheduling), as an Eagle engine's plain steps.
    With all_barriers every step proposes, as in an Eagle batch that always drafts."""

    runner: FakeRunner
    all_barriers: bool = False
    dispatched: int = 0
    events: list[str] = field(default_factory=list)  # "dispatch", "collect", "collect barrier"

    def dispatch(self, out: SchedulerOutput) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        self.dispatched += 1
        self.events.append("dispatch")
        result = self.runner.execute(out)
        if not self.all_barriers and self.dispatched % 3 and result.spec_token_ids is not None:
            result.spec_token_ids = [[] for _ in result.spec_token_ids]
        return out, result

    def collect(self, pending: tuple[SchedulerOutput, ModelRunnerOutput]) -> ModelRunnerOutput:
        self.events.append("collect" if self.pipelines(pending) else "collect barrier")
        return pending[1]

    def pipelines(self, pending: tuple[SchedulerOutput, ModelRunnerOutput]) -> bool:
        out, result = pending
        drafts = result.spec_token_ids or []
        return not out.scheduled_spec_decode_tokens and not any(drafts)

    def drafts_ahead(self, pending: tuple[SchedulerOutput, ModelRunnerOutput]
                     ) -> dict[str, list[int]]:
        return {}

    def resyncs(self) -> dict[str, int]:
        return {}

    def rewound(self, computed: Mapping[str, int]) -> None:
        pass


@pytest.mark.parametrize("num_pages", [200, 14])
def test_async_core_pipelines_plain_steps_and_verifies_drafts(num_pages: int) -> None:
    s = make_scheduler(async_scheduling=True, num_spec=3, num_pages=num_pages, max_model_len=32,
                       max_num_batched_tokens=32)
    for k, p in enumerate(PROMPTS):
        s.add_request(make_request(f"r{k}", p, 12, ignore_eos=True))
    core = EngineCore(s, _MixedExecutor(FakeRunner(4, drafts=3)), async_scheduling=True)
    got = Collected()
    for _ in range(500):
        if not core.has_work():
            break
        got.add(core.step())
    accepted = 0
    for k, p in enumerate(PROMPTS):
        assert got.tokens[f"r{k}"] == reference_output(p, 12)
        assert got.reason(f"r{k}") is FinishReason.LENGTH
        accepted += sum(o.num_accepted_tokens for o in got.outputs[f"r{k}"])
    assert accepted > 0 and core.num_overlapped_steps > 0 and core.num_early_steps > 0
    kv = s.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages
    assert all(r.num_output_placeholders == 0 for r in s.requests.values())


@pytest.mark.parametrize("all_barriers", [False, True])
def test_the_step_after_a_verification_is_dispatched_before_its_outputs_return(
        all_barriers: bool) -> None:
    s = make_scheduler(async_scheduling=True, num_spec=3, max_model_len=32,
                       max_num_batched_tokens=32)
    for k, p in enumerate(PROMPTS):
        s.add_request(make_request(f"r{k}", p, 12, ignore_eos=True))
    executor = _MixedExecutor(FakeRunner(4, drafts=3), all_barriers)
    core = EngineCore(s, executor, async_scheduling=True)
    got, barriers = Collected(), 0
    for _ in range(500):
        if not core.has_work():
            break
        seen = len(executor.events)
        got.add(core.step())
        events = executor.events[seen:]
        if "collect barrier" in events and core.has_work():
            # The verified step's outputs come back with the next step already
            # on the device, so that their processing overlaps it.
            barriers += 1
            assert events[events.index("collect barrier"):] == ["collect barrier", "dispatch"]
    assert barriers > 3 and core.num_early_steps == barriers
    for k, p in enumerate(PROMPTS):
        assert got.tokens[f"r{k}"] == reference_output(p, 12)


def runner_output(req: str, sampled: list[int], drafts: list[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput([req], {req: 0}, [sampled], [drafts])


def test_rejected_drafts_roll_num_computed_tokens_back() -> None:
    s = make_scheduler(num_spec=3, page_size=4)
    a = make_request("a", [1, 2, 3, 4], 20, ignore_eos=True)
    s.add_request(a)
    out = s.schedule()
    # Lookahead: room for the 3 drafts the proposer writes after the prompt.
    assert s.kv_cache_manager.get_pages("a").page_ids == ((1, 2),)
    s.update_from_output(out, runner_output("a", [10], [11, 12, 13]))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert out.scheduled_cached_reqs.num_computed_tokens == [4]
    assert len(s.kv_cache_manager.get_pages("a").page_ids[0]) == 3  # 4 + 4 + 3 lookahead
    result = s.update_from_output(out, runner_output("a", [11, 20], [21]))
    (o,) = result[0].outputs
    assert (o.new_token_ids, o.num_draft_tokens, o.num_accepted_tokens) == ([11, 20], 3, 1)
    assert (a.num_computed_tokens, a.num_tokens, a.spec_token_ids) == (6, 7, [21])
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.scheduled_cached_reqs.num_computed_tokens == [6]
    result = s.update_from_output(out, runner_output("a", [21, 22], []))
    assert (result[0].outputs[0].num_accepted_tokens, a.num_computed_tokens) == (1, 8)
    out = s.schedule()
    assert (out.num_scheduled_tokens, out.scheduled_spec_decode_tokens) == ({"a": 1}, {})


def test_drafts_are_used_once_even_without_new_ones() -> None:
    s = make_scheduler(num_spec=2)
    s.add_request(make_request("a", [1, 2, 3, 4], 20, ignore_eos=True))
    out = s.schedule()
    s.update_from_output(out, runner_output("a", [10], [11, 12]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12]}
    s.update_from_output(out, ModelRunnerOutput(["a"], {"a": 0}, [[11, 30]], None))
    out = s.schedule()
    assert (out.num_scheduled_tokens, out.scheduled_spec_decode_tokens) == ({"a": 1}, {})


def test_drafts_never_push_past_max_model_len() -> None:
    s = make_scheduler(num_spec=3, max_model_len=16, max_num_batched_tokens=16)
    prompt = list(range(1, 13))
    s.add_request(make_request("a", prompt, None, ignore_eos=True))
    got = run(s, FakeRunner(4, drafts=3))
    assert got.tokens["a"] == reference_output(prompt, 4)
    assert got.reason("a") is FinishReason.LENGTH


def test_too_many_sampled_tokens_is_an_error() -> None:
    s = make_scheduler(num_spec=1)
    s.add_request(make_request("a", [1, 2, 3, 4], 20))
    out = s.schedule()
    with pytest.raises(ValueError, match="sampled tokens"):
        s.update_from_output(out, runner_output("a", [1, 2], []))


@pytest.mark.parametrize("num_pages", [200, 14])
def test_speculation_gives_the_reference_tokens(num_pages: int) -> None:
    s = make_scheduler(num_spec=3, num_pages=num_pages, max_model_len=32,
                       max_num_batched_tokens=32)
    for k, p in enumerate(PROMPTS):
        s.add_request(make_request(f"r{k}", p, 12, ignore_eos=True))
    runner = FakeRunner(4, drafts=3)
    got = run(s, runner)
    drafted = accepted = 0
    for k, p in enumerate(PROMPTS):
        assert got.tokens[f"r{k}"] == reference_output(p, 12)
        drafted += sum(o.num_draft_tokens for o in got.outputs[f"r{k}"])
        accepted += sum(o.num_accepted_tokens for o in got.outputs[f"r{k}"])
    assert 0 < accepted < drafted
    assert runner.steps < 5 * 12  # speculation saved steps
    kv = s.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)
