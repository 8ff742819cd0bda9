"""The continuous-batching scheduler: one rule for prefill, decode and speculation.

Every step moves each scheduled request's `num_computed_tokens` toward
`num_tokens_with_spec` (plus async placeholders) within the token budget
`max_num_batched_tokens`: running requests first, in running order, then
waiting ones while `max_num_seqs`, the seq buckets and the pages allow. A fresh
prompt, a chunk of one, a prefix-cache hit, a decode token and a run of draft
tokens are all the same thing here: tokens between num_computed_tokens and the
request's target.

Ordering. `policy='fcfs'` admits in add_request order; the running list is kept in
admission order and preemption evicts its tail (the last admitted).
`policy='priority'` admits by (priority, arrival time), *lower priority value
first*; the running list is kept sorted the same way, so it is scheduled in
priority order and preemption evicts its tail: the highest priority value, the
latest arrival on ties. A preempted request goes back to the front of the FCFS
queue, or to its priority slot. Waiting requests never preempt running ones;
only a running request that cannot grow does.

Preemption is by recompute: pages freed, num_computed_tokens reset to 0,
status PREEMPTED. When the request is admitted again it is sent to the runner
as a NewRequestData carrying its output tokens so far, and its prompt plus
outputs are prefilled again (prefix hits usually make that cheap).

Async scheduling with speculation. A step that verifies drafts holds a
placeholder per draft and for its sampled token, counts its drafts as
computed, and its update rolls back over the rejected ones; it must be
updated before the next schedule() (refused before), unless the runner handed
its proposals ahead (take_drafts): the next step then verifies them, planned
as if every draft in flight were accepted. Drafts that arrive while a later
step of the request is already scheduled are dropped (wrong tokens behind).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from esurge.config import Config, SchedulingPolicy
from esurge.core.kv_cache_manager import KVCacheManager
from esurge.core.kv_cache_spec import CacheGroupsConfig
from esurge.engine_types import EngineCoreEventType, EngineCoreOutputs
from esurge.errors import InvalidRequestError, RequestField
from esurge.outputs import ModelRunnerOutput
from esurge.request import EngineRequest, EngineRequestStatus
from esurge.scheduler.admission import check_fits
from esurge.scheduler.buckets import SeqBuckets
from esurge.scheduler.decode_burst import DecodeBurstPolicy, check_decode_steps
from esurge.scheduler.interface import SchedulerInterface, SchedulerSource
from esurge.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from esurge.scheduler.request_queue import create_request_queue, priority_key
from esurge.scheduler.step_plan import StepPlan
from esurge.scheduler.step_update import StepUpdate

__all__ = ["Scheduler"]

_RUNNING = EngineRequestStatus.RUNNING
_PREEMPTED = EngineRequestStatus.PREEMPTED


class Scheduler(SchedulerInterface):
    """Schedules requests over a paged KV cache (see the module docstring).

    include_finished_set: fill EngineCoreOutputs.finished_requests with the ids
        of each client's requests that ended in that update.
    max_num_seq_buckets: request-count buckets the runner pads to; overrides
        SchedulerConfig.max_num_seq_buckets. The running count never exceeds
        the largest bucket.
    decode_steps: decode iterations per step when every running request can
        take a burst of them (see decode_burst.py); 1 turns bursts off. The
        runner must be built for the same value.
    """

    def __init__(self, config: Config, kv_cache_config: CacheGroupsConfig,
                 include_finished_set: bool = False,
                 max_num_seq_buckets: list[int] | None = None, decode_steps: int = 1) -> None:
        if not isinstance(config, Config):
            raise ValueError(f"config must be a Config, got {type(config).__name__}")
        if not isinstance(kv_cache_config, CacheGroupsConfig):
            raise ValueError(f"kv_cache_config must be a CacheGroupsConfig, got "
                             f"{type(kv_cache_config).__name__}")
        sched, cache = config.scheduler_config, config.cache_config
        if kv_cache_config.page_size != cache.page_size:
            raise ValueError(f"kv_cache_config.page_size ({kv_cache_config.page_size}) differs "
                             f"from cache_config.page_size ({cache.page_size})")
        if cache.num_pages is not None and cache.num_pages != kv_cache_config.num_pages:
            raise ValueError(f"kv_cache_config.num_pages ({kv_cache_config.num_pages}) differs "
                             f"from cache_config.num_pages ({cache.num_pages})")
        self.num_lookahead_tokens = config.num_speculative_tokens
        self._burst = DecodeBurstPolicy(
            check_decode_steps(decode_steps, self.num_lookahead_tokens), sched.max_model_len,
            sched.max_num_batched_tokens, cache.page_size, len(kv_cache_config.groups))
        self.config = config
        self.scheduler_config = sched
        self.max_model_len = sched.max_model_len
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.policy = sched.scheduling_policy
        self.async_scheduling = sched.async_scheduling
        self.chunked_prefill = sched.chunked_prefill_enabled
        # The threshold only caps chunks; whole prompts are never split.
        self.long_prefill_threshold = (sched.long_prefill_token_threshold
                                       if self.chunked_prefill else 0)
        self.include_finished_set = include_finished_set
        self.kv_cache_config = kv_cache_config
        self.kv_cache_manager = KVCacheManager(kv_cache_config, sched.max_model_len,
                                               enable_caching=cache.enable_prefix_caching)
        buckets = max_num_seq_buckets if max_num_seq_buckets is not None else (
            sched.max_num_seq_buckets)
        self.seq_buckets = SeqBuckets(buckets, sched.max_num_seqs)
        self.max_num_running = self.seq_buckets.max_running
        margin_pages = math.ceil((sched.token_safety_margin or 0) / cache.page_size)
        # Every group grows by its own page when a decode crosses a page boundary.
        self.reserve_pages_per_request = margin_pages * self.kv_cache_manager.num_groups
        self.requests: dict[str, EngineRequest] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[EngineRequest] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # since start, for metrics
        self.num_decode_bursts = 0  # steps scheduled as decode bursts, since start
        # Ended through finish_requests: their final outputs go out in the next update.
        self._finished_outside: list[EngineRequest] = []
        # A published step that verifies drafts and whose output is not applied yet.
        self._verifying = False

    @classmethod
    def from_runner(cls, runner: SchedulerSource, max_num_batched_tokens: int | None = None,
                    enable_prefix_caching: bool = True) -> Scheduler:
        """A scheduler for a runner's model and page pool.

        The cache groups are the runner's own (detected from the model's
        attention types when it was loaded: full, sliding window, chunked
        local), over the page pool it allocated. max_num_batched_tokens None
        keeps the budget of runner.config (the engine sets it to max_model_len
        unless told otherwise); the runner's max_model_len, page count and
        decode_steps, and enable_prefix_caching, override the config.
        """
        config = runner.config
        groups = runner.cache_groups
        sched = replace(
            config.scheduler_config,
            max_model_len=int(runner.max_model_len),
            max_num_batched_tokens=(config.scheduler_config.max_num_batched_tokens
                                    if max_num_batched_tokens is None
                                    else max_num_batched_tokens),
        )
        cache = replace(config.cache_config, num_pages=groups.num_pages,
                        enable_prefix_caching=enable_prefix_caching)
        return cls(replace(config, scheduler_config=sched, cache_config=cache), groups,
                   decode_steps=runner.decode_steps)

    # ---- requests in and out ---------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request; ValueError for a duplicate live id or one that can never fit."""
        rid = request.request_id
        if rid in self.requests:
            raise InvalidRequestError(RequestField.REQUEST_ID,
                                      f"request id {rid!r} is already in use by a live request")
        if request.status is not EngineRequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} must be new (status WAITING, nothing computed), "
                             f"got status {request.status.name}")
        check_fits(request, self.kv_cache_manager, self.max_model_len,
                   self.num_lookahead_tokens, self._max_tokens_per_step())
        self.requests[rid] = request
        self.waiting.add(request)
        request.record_event(EngineCoreEventType.QUEUED)

    def _max_tokens_per_step(self) -> int | None:
        """The most prompt tokens one request gets per step (None: all at once)."""
        if not self.chunked_prefill:
            return None
        if self.long_prefill_threshold:
            return min(self.long_prefill_threshold, self.max_num_batched_tokens)
        return self.max_num_batched_tokens

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: EngineRequestStatus) -> None:
        """End live requests from outside (abort, stop string); unknown or ended ids are
        ignored. Pages are freed now; a final output goes out in the next update."""
        if not EngineRequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a finished status, got {finished_status!r}")
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        done_running: set[EngineRequest] = set()
        done_waiting: set[EngineRequest] = set()
        for rid in ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            (done_running if request.status is _RUNNING else done_waiting).add(request)
            request.status = finished_status
            self._release(request)
            self._finished_outside.append(request)
        if done_running:
            self.running = [r for r in self.running if r not in done_running]
        if done_waiting:
            self.waiting.remove_many(done_waiting)

    def _release(self, request: EngineRequest) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # ---- scheduling -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next forward pass (see the module docstring).

        ValueError while a step that verifies drafts awaits its output: how
        many it accepts decides where every request in it goes on from."""
        if self._verifying:
            raise ValueError("schedule() called before the output of a step with draft "
                             "tokens was applied (update_from_output)")
        budget = self.max_num_batched_tokens
        plan = StepPlan(self._burst.steps(
            self.running, len(self.waiting), len(self.running) >= self.max_num_running,
            self.kv_cache_manager.num_free_pages, lambda r: self._num_new_tokens(r, budget)))
        budget = self._schedule_running(plan, budget)
        # A preemption means pages are short: admitting now would only thrash.
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        return self._publish(plan)

    def take_drafts(self, drafts: Mapping[str, Sequence[int]]) -> None:
        """Drafts proposed by the step just published, for the next to verify
        before its output arrives (see the module docstring); async scheduling only."""
        if not self.async_scheduling:
            raise ValueError("drafts ahead of a step's output need async_scheduling")
        for rid, ids in drafts.items():
            request = self.requests.get(rid)
            if request is not None and request.status is _RUNNING:
                request.spec_token_ids = ids
        self._verifying = False

    def rewind(self, positions: Mapping[str, int]) -> dict[str, int]:
        """Move running requests back to compute again from these positions: an
        Eagle head whose cache stops there (its request decoded plain steps)
        gets the target's features of the tokens after it from the step that
        recomputes them. The pages stay; only a request with no step in
        flight (no placeholders) and no drafts waiting moves. Returns those
        moved, with how far each had computed."""
        moved = {}
        for rid, position in positions.items():
            request = self.requests.get(rid)
            if (request is None or request.status is not _RUNNING
                    or request.num_output_placeholders or request.spec_token_ids
                    or not 0 <= position < request.num_computed_tokens):
                continue
            moved[rid] = request.num_computed_tokens
            request.num_computed_tokens = position
        return moved

    def _num_new_tokens(self, request: EngineRequest, budget: int) -> int:
        placeholders = request.num_output_placeholders
        if placeholders:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None and request.num_output_tokens + placeholders >= max_tokens:
                return 0  # every token it may still output is already on its way
        num_new = (len(request.all_token_ids) + len(request.spec_token_ids) + placeholders
                   - request.num_computed_tokens)
        threshold = self.long_prefill_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        # Position max_model_len - 1 would only sample a token past the limit.
        return min(num_new, budget, self.max_model_len - 1 - request.num_computed_tokens)

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        kv = self.kv_cache_manager
        lookahead = self.num_lookahead_tokens
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new > 0 and plan.decode_steps > 1:
                num_new = plan.decode_steps  # a burst is only planned where num_new is 1
            if num_new <= 0:
                i += 1
                continue
            while True:
                pages = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                if pages is not None:
                    break
                victim = running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    return budget
            rid = request.request_id
            plan.num_scheduled[rid] = num_new
            plan.running.append(request)
            plan.running_pages.append(pages)
            if request.spec_token_ids:
                num_spec = (request.num_computed_tokens + num_new - len(request.all_token_ids)
                            - request.num_output_placeholders)
                if num_spec > 0:
                    plan.spec[rid] = request.spec_token_ids[:num_spec]
                # Drafts not verified now would be stale after this step.
                request.spec_token_ids = []
            budget -= num_new
            i += 1
        return budget

    def _preempt(self, request: EngineRequest, plan: StepPlan) -> None:
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.add_preempted(request)
        plan.preempted.add(request.request_id)

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        kv = self.kv_cache_manager
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_running:
            # A preempted request never has async tokens in flight here: it is
            # not admitted in the step that preempted it, and its last step's
            # output is applied before the next schedule().
            request = waiting.peek()
            hit_pages, num_hit = kv.get_computed_pages(request)
            num_new = request.num_tokens - num_hit
            if self.chunked_prefill:
                if 0 < self.long_prefill_threshold < num_new:
                    num_new = self.long_prefill_threshold
                num_new = min(num_new, budget)
            elif num_new > budget:
                break  # whole prompts only: keep the queue order rather than skip ahead
            if kv.allocate_slots(request, num_new, num_hit, hit_pages,
                                 self.num_lookahead_tokens) is None:
                break
            reserve = self.reserve_pages_per_request * len(self.running)
            if reserve and kv.num_free_pages < reserve:
                kv.free(request)  # admitting it would eat the running requests' headroom
                break
            waiting.pop()
            self._admit(request, num_hit, num_new, plan)
            budget -= num_new

    def _admit(self, request: EngineRequest, num_hit: int, num_new: int,
               plan: StepPlan) -> None:
        request.status = _RUNNING
        request.record_event(EngineCoreEventType.SCHEDULED)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        if self.policy is SchedulingPolicy.PRIORITY:
            bisect.insort(self.running, request, key=priority_key)
        else:
            self.running.append(request)
        plan.new_reqs.append(request)
        plan.num_scheduled[request.request_id] = num_new

    def _publish(self, plan: StepPlan) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = [NewRequestData.from_request(r, kv.get_pages(r.request_id).page_ids)
                    for r in plan.new_reqs]
        running = plan.running
        cached = CachedRequestData(
            req_ids=[r.request_id for r in running],
            new_page_ids=[None if p.is_empty() else p.page_ids for p in plan.running_pages],
            num_computed_tokens=[r.num_computed_tokens for r in running],
        )
        num_scheduled = plan.num_scheduled
        if plan.decode_steps > 1 and num_scheduled:
            self.num_decode_bursts += 1
        plan.advance(self.async_scheduling)
        self._verifying = bool(plan.spec)
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=plan.spec,
            finished_req_ids=finished,
            preempted_req_ids=plan.preempted,
            num_seq_bucket=self.seq_buckets.bucket_for(len(num_scheduled)),
            num_decode_steps=plan.decode_steps,
            num_waiting_reqs=len(self.waiting),
        )

    # ---- outputs ------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput
                           ) -> dict[int, EngineCoreOutputs]:
        """Apply a step's sampled tokens, stop finished requests (freeing their pages
        at once) and return each client's new outputs.

        A request gets an output when it has new tokens, ends, or has prompt
        logprobs for this step; num_cached_tokens (its prefix-hit length at
        first admission) is set on every output, the first one included.
        Requests ended by finish_requests since the last update get their
        final output here. Tokens of requests that ended after being
        scheduled (async scheduling, aborts) are dropped.
        """
        if scheduler_output.scheduled_spec_decode_tokens:
            self._verifying = False
        update = StepUpdate(self.requests, self.max_model_len, self.async_scheduling)
        update.apply(scheduler_output, model_runner_output)
        for request in update.finished:
            self._release(request)
        if update.finished_running:
            done = update.finished_running
            self.running = [r for r in self.running if r not in done]
        if update.finished_waiting:
            self.waiting.remove_many(update.finished_waiting)
        for request in self._finished_outside:
            update.add_final(request)
        self._finished_outside = []
        return update.collect(self.include_finished_set, time.monotonic())

    # ---- queries ----------------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, running or preempted."""
        return len(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting); preempted requests count as waiting."""
        return len(self.running), len(self.waiting)

    def has_finished_requests(self) -> bool:
        """True when ids finished since the last schedule() still go to the runner."""
        return len(self.finished_req_ids) > 0

    def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes (e.g. after a weight update); False while pages are held."""
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Abort every live request, freeing its pages; final outputs still go out
        with the next update_from_output."""
        self.finish_requests(list(self.requests), EngineRequestStatus.FINISHED_ABORTED)
