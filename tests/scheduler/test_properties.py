"""Property: under random arrivals, priorities, lengths, aborts and page budgets, every
request ends exactly once with the right tokens and the page pool ends whole."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from esurge.engine_types import FinishReason
from esurge.outputs import ModelRunnerOutput
from esurge.request import EngineRequestStatus
from esurge.scheduler import SchedulerOutput
from tests.scheduler.fakes import (
    Collected,
    FakeRunner,
    make_request,
    make_scheduler,
    reference_output,
)

MAX_MODEL_LEN = 32


@dataclass(frozen=True)
class Arrival:
    prompt: list[int]
    max_tokens: int
    eos: int | None
    priority: int
    step: int
    abort_step: int | None


@dataclass(frozen=True)
class Scenario:
    page_size: int
    num_pages: int
    policy: str
    chunked: bool
    budget: int
    threshold: int
    async_scheduling: bool
    num_spec: int
    max_num_seqs: int
    margin: int | None
    arrivals: list[Arrival]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    chunked = draw(st.booleans())
    async_scheduling = draw(st.booleans())
    arrival = st.builds(
        Arrival,
        # Few distinct prompt families so prefixes are shared and hit the cache.
        prompt=st.tuples(st.integers(0, 2), st.integers(1, 14)).map(
            lambda fl: [(fl[0] * 17 + 3 * i) % 50 for i in range(fl[1])]),
        max_tokens=st.integers(1, 12),
        eos=st.one_of(st.none(), st.integers(0, 49)),
        priority=st.integers(0, 2),
        step=st.integers(0, 10),
        abort_step=st.one_of(st.none(), st.integers(0, 25)),
    )
    return Scenario(
        page_size=draw(st.sampled_from([2, 4])),
        num_pages=draw(st.integers(4, 16)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        chunked=chunked,
        budget=draw(st.integers(4, MAX_MODEL_LEN)) if chunked else MAX_MODEL_LEN,
        threshold=draw(st.sampled_from([0, 3])),
        async_scheduling=async_scheduling,
        num_spec=0 if async_scheduling else draw(st.sampled_from([0, 2])),
        max_num_seqs=draw(st.integers(1, 4)),
        margin=draw(st.sampled_from([None, 4])),
        arrivals=draw(st.lists(arrival, min_size=1, max_size=8)),
    )


def fits(sc: Scenario, a: Arrival) -> bool:
    """Full attention only: the request's KV pages must fit in the usable pool."""
    final = len(a.prompt) + a.max_tokens
    kv_tokens = min(final - 1 + sc.num_spec, MAX_MODEL_LEN)
    return final <= MAX_MODEL_LEN and -(-kv_tokens // sc.page_size) <= sc.num_pages - 1


@settings(max_examples=300, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_request_ends_once_and_the_pool_is_whole(sc: Scenario) -> None:
    s = make_scheduler(page_size=sc.page_size, num_pages=sc.num_pages, policy=sc.policy,
                       chunked=sc.chunked, max_num_batched_tokens=sc.budget,
                       threshold=sc.threshold, async_scheduling=sc.async_scheduling,
                       num_spec=sc.num_spec, max_num_seqs=sc.max_num_seqs, margin=sc.margin,
                       max_model_len=MAX_MODEL_LEN)
    runner = FakeRunner(sc.page_size, drafts=sc.num_spec)
    got = Collected()
    accepted: dict[str, Arrival] = {}
    pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    last_arrival = max(a.step for a in sc.arrivals)
    for step in range(400):
        for k, a in enumerate(sc.arrivals):
            if a.step == step:
                rid = f"r{k}"
                try:
                    s.add_request(make_request(rid, a.prompt, a.max_tokens, eos=a.eos,
                                               priority=a.priority, arrival=float(k)))
                    accepted[rid] = a
                except ValueError:
                    assert not fits(sc, a), rid
                else:
                    assert fits(sc, a), rid
            if a.abort_step == step:
                s.finish_requests(f"r{k}", EngineRequestStatus.FINISHED_ABORTED)
        if step > last_arrival and not s.has_requests() and pending is None:
            break
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= sc.budget
        assert len(out.num_scheduled_tokens) <= sc.max_num_seqs
        assert s.get_request_counts()[0] <= sc.max_num_seqs
        result = runner.execute(out)
        if pending is not None:
            got.add(s.update_from_output(*pending))
            pending = None
        if sc.async_scheduling and out.num_scheduled_tokens:
            pending = (out, result)
        else:
            got.add(s.update_from_output(out, result))
    else:
        raise AssertionError("requests left unfinished")
    assert set(got.finals) == set(accepted)
    for rid, a in accepted.items():
        reason = got.reason(rid)  # exactly one final output
        expected = reference_output(a.prompt, a.max_tokens, eos=a.eos)
        if reason is FinishReason.ABORT:
            assert got.tokens.get(rid, []) == expected[:len(got.tokens.get(rid, []))]
        else:
            assert got.tokens[rid] == expected
    kv = s.kv_cache_manager
    assert (kv.num_free_pages, kv.usage) == (kv.num_usable_pages, 0.0)
    assert s.get_num_unfinished_requests() == 0
