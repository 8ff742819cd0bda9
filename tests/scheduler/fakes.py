"""A deterministic fake model and a runner that honours the SchedulerOutput contract.

The fake runner keeps its own per-request state exactly as a real runner must:
it learns requests from NewRequestData, applies CachedRequestData diffs, drops
finished and preempted ids, appends the tokens it samples itself and checks
that every scheduled token lies inside the pages it was given. Its "model" is
next token = f(all previous tokens), so any scheduling mistake (a lost, doubled
or misplaced token) changes the final output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from esurge.config import CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from esurge.core import CacheGroupsConfig, FullAttentionSpec, KVCacheGroup
from esurge.engine_types import EngineCoreOutput, EngineCoreOutputs, FinishReason
from esurge.outputs import ModelRunnerOutput, TokenLogprobs
from esurge.request import EngineRequest
from esurge.sampling_params import SamplingParams
from esurge.scheduler import Scheduler, SchedulerOutput

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    acc = len(tokens)
    for i, t in enumerate(tokens):
        acc = (acc * 31 + (i + 1) * (t + 7)) % 1_000_003
    return acc % VOCAB


def reference_output(prompt: list[int], max_tokens: int, eos: int | None = None,
                     stop_token_ids: tuple[int, ...] = (), min_tokens: int = 0) -> list[int]:
    """What an unconstrained engine must output for one request."""
    tokens = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
        if len(out) >= min_tokens and (tok == eos or tok in stop_token_ids):
            break
    return out


def make_config(*, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                max_model_len: int = 64, page_size: int = 4, num_pages: int = 64,
                policy: str = "fcfs", chunked: bool = False, threshold: int = 0,
                margin: int | None = None, buckets: tuple[int, ...] | None = None,
                async_scheduling: bool = False, prefix_caching: bool = True,
                num_spec: int = 0) -> tuple[Config, CacheGroupsConfig]:
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, policy=policy,  # type: ignore[arg-type]
        long_prefill_token_threshold=threshold, chunked_prefill_enabled=chunked,
        token_safety_margin=margin, max_num_seq_buckets=buckets,
        async_scheduling=async_scheduling)
    spec = (SpeculativeConfig(num_speculative_tokens=num_spec, speculative_model="/draft")
            if num_spec else None)
    config = Config(sched, CacheConfig(num_pages, page_size, prefix_caching), spec)
    groups = CacheGroupsConfig(num_pages, (KVCacheGroup(
        (0,), FullAttentionSpec(page_size=page_size, num_kv_heads=1, head_dim=8)),))
    return config, groups


def make_scheduler(include_finished_set: bool = False,
                   seq_buckets: list[int] | None = None, decode_steps: int = 1,
                   **kw: object) -> Scheduler:
    config, groups = make_config(**kw)  # type: ignore[arg-type]
    return Scheduler(config, groups, include_finished_set, seq_buckets, decode_steps=decode_steps)


def make_request(rid: str, prompt: list[int] | int, max_tokens: int | None = 8, *,
                 eos: int | None = None, priority: int = 0, arrival: float = 0.0,
                 client: int = 0, **params: object) -> EngineRequest:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    sp = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return EngineRequest(rid, tokens, sp, eos_token_id=eos, client_index=client,
                         priority=priority, arrival_time=arrival)


@dataclass
class _RunnerRequest:
    tokens: list[int]
    computed: int
    pages: list[list[int]]
    params: SamplingParams


@dataclass
class FakeRunner:
    """Executes SchedulerOutputs with the fake model.

    drafts > 0 proposes that many draft tokens per request: the first
    `good(tokens)` of them are the model's own continuation, the rest wrong.
    """

    page_size: int
    drafts: int = 0
    states: dict[str, _RunnerRequest] = field(default_factory=dict)
    steps: int = 0
    # Drafts a step still in flight rejected, by request: the scheduler counted
    # them as computed (it handed that step's drafts ahead), a runner moves back.
    moved_back: dict[str, int] = field(default_factory=dict)

    def resyncs(self) -> dict[str, int]:
        """Nothing to compute again (EngineCore asks before each step)."""
        return {}

    def rewound(self, computed: Mapping[str, int]) -> None:
        """Nothing moves back."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.states.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states
            self.states[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                new.num_computed_tokens, [list(g) for g in new.page_ids], new.sampling_params)
        cached = out.scheduled_cached_reqs
        for k, rid in enumerate(cached.req_ids):
            state = self.states[rid]
            ahead = self.moved_back.get(rid, 0)
            assert state.computed == cached.num_computed_tokens[k] - ahead, rid
            new_pages = cached.new_page_ids[k]
            if new_pages is not None:
                for pages, extra in zip(state.pages, new_pages, strict=True):
                    pages.extend(extra)
        req_ids = list(out.num_scheduled_tokens)
        sampled = [self._run(rid, n, out.scheduled_spec_decode_tokens.get(rid, []),
                             out.num_decode_steps)
                   for rid, n in out.num_scheduled_tokens.items()]
        spec = [self._propose(rid) if s else [] for rid, s in zip(req_ids, sampled, strict=True)]
        logprobs = [[_logprob(t) for t in s] if self.states[rid].params.logprobs is not None
                    else None for rid, s in zip(req_ids, sampled, strict=True)]
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled,
                                 spec if self.drafts else None, logprobs)

    def _run(self, rid: str, num: int, drafts: list[int], steps: int = 1) -> list[int]:
        state = self.states[rid]
        end = state.computed + num
        assert len(state.pages[0]) * self.page_size >= end, "tokens beyond the given pages"
        assert 0 not in state.pages[0][: -(-end // self.page_size)], "null page in use"
        known = len(state.tokens)
        if steps > 1:  # a decode burst: one known token, then its own outputs
            assert num == steps and not drafts and known - state.computed == 1, rid
            burst: list[int] = []
            for _ in range(steps):
                burst.append(next_token(state.tokens + burst))
            state.computed = known + steps - 1
            state.tokens.extend(burst)
            return burst
        assert end <= known + len(drafts), "scheduled past the known tokens"
        if end < known:
            state.computed = end
            return []  # a prompt chunk: nothing sampled yet
        out: list[int] = []
        for d in drafts:
            tok = next_token(state.tokens + out)
            out.append(tok)
            if tok != d:
                break
        else:
            out.append(next_token(state.tokens + out))
        state.computed = known + len(out) - 1
        state.tokens.extend(out)
        return out

    def _propose(self, rid: str) -> list[int]:
        tokens = list(self.states[rid].tokens)
        good = len(tokens) % (self.drafts + 1)
        proposal: list[int] = []
        for k in range(self.drafts):
            tok = next_token(tokens)
            if k >= good:
                tok = (tok + 1) % VOCAB
            proposal.append(tok)
            tokens.append(tok)
        return proposal


def _logprob(token: int) -> TokenLogprobs:
    return TokenLogprobs((token,), (-float(token),), 1)


@dataclass
class Collected:
    """Everything the clients received, per request."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finals: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    finished_sets: list[set[str]] = field(default_factory=list)

    def add(self, result: dict[int, EngineCoreOutputs]) -> None:
        for client_outputs in result.values():
            if client_outputs.finished_requests is not None:
                self.finished_sets.append(set(client_outputs.finished_requests))
            for o in client_outputs.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                self.outputs.setdefault(o.request_id, []).append(o)
                if o.finished:
                    self.finals.setdefault(o.request_id, []).append(o)

    def reason(self, rid: str) -> FinishReason | None:
        finals = self.finals[rid]
        assert len(finals) == 1, f"{rid} ended {len(finals)} times"
        return finals[0].finish_reason


def run(scheduler: Scheduler, runner: FakeRunner | None = None, max_steps: int = 2000,
        collected: Collected | None = None) -> Collected:
    """Drive schedule -> execute -> update until every request ended.

    With async scheduling, step N+1 is scheduled and executed before step N's
    output is applied, as the engine's async loop does.
    """
    runner = runner or FakeRunner(scheduler.kv_cache_manager.page_size)
    got = collected or Collected()
    pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    for _ in range(max_steps):
        if not scheduler.has_requests() and pending is None:
            return got
        out = scheduler.schedule()
        result = runner.execute(out)
        if scheduler.async_scheduling:
            if pending is not None:
                got.add(scheduler.update_from_output(*pending))
                pending = None
            if out.num_scheduled_tokens:
                pending = (out, result)
            else:
                got.add(scheduler.update_from_output(out, result))
        else:
            got.add(scheduler.update_from_output(out, result))
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
