"""eSurgeRunner: turns each SchedulerOutput into one jitted model step.

The runner keeps the persistent batch on the host, builds each step's inputs
with numpy (one transfer per step), pads them to precompiled (tokens,
requests) buckets and runs the model and the sampler on the device. With
async scheduling the next step is dispatched before the previous one's tokens
reach the host: those inputs are read on the device from the previous
sampler output.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import jax
import jax.numpy as jnp

from esurge.config import Config
from esurge.core.kv_cache_spec import CacheGroupsConfig, FullAttentionSpec
from esurge.core.page_budget import stable_page_count
from esurge.models.kv_cache import KVCache, init_kv_cache
from esurge.models.loader import LoadedModel
from esurge.models.paged_attention import kernel_serves
from esurge.models.tensor_parallel import kv_cache_sharding, replicated, tp_degree
from esurge.outputs import ModelRunnerOutput
from esurge.runner.buckets import StepBuckets
from esurge.runner.input_batch import InputBatch
from esurge.runner.prompt_logprobs import PromptLogprobsComputer
from esurge.runner.real_rows import one_row_at_a_time
from esurge.runner.sampler import SamplerVariant
from esurge.runner.step_inputs import build_step_inputs
from esurge.runner.steps.base import DeviceState, PendingStep, StepKind, StepPlan
from esurge.runner.steps.burst import DecodeBurstStep
from esurge.runner.steps.plain import GrammarFeed, GreedyStep, SampledStep, record_plain
from esurge.runner.steps.speculative import SpeculativeStep
from esurge.runner.steps.speculative.calibrate import measure_step_costs
from esurge.runner.steps.speculative.decoder import SpecDecoder
from esurge.runner.warmup import warm_up
from esurge.scheduler.output import NewRequestData, SchedulerOutput
from esurge.settings import EngineSettings
from esurge.spec_decode.policy import make_policy
from esurge.spec_decode.stats import SpecStatsSnapshot
from esurge.structured_output.batch import GrammarBatch

__all__ = ["WarmupProgress", "eSurgeRunner"]

log = logging.getLogger(__name__)

WarmupProgress = Callable[[int, int, str], None]


def _stop_ids(new: NewRequestData) -> tuple[int, ...]:
    """The tokens that end a request (and that its grammar allows where it accepts)."""
    params = new.sampling_params
    eos = () if new.eos_token_id is None or params.ignore_eos else (new.eos_token_id,)
    return tuple(params.stop_token_ids) + eos


def _available_host_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _available_device_bytes() -> int:
    stats = jax.local_devices()[0].memory_stats() or {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    return int(limit - used) if limit else _available_host_bytes()


class eSurgeRunner:
    """Runs scheduled steps of one loaded model over a paged KV cache.

    Each step goes to the first of `step_kinds` that accepts it (see
    `esurge.runner.steps`); warm-up compiles what those kinds can run. With
    `config.speculative_config` enabling Eagle, `spec` holds the draft head;
    steps verify and propose drafts where its speculation policy says
    drafting pays (EngineSettings.speculation), else run plain; under async
    scheduling the plain ones pipeline, and so do steady speculative ones,
    which hand their drafts ahead (`drafts_ahead`); any other speculative one
    is collected before the next step is scheduled (`pipelines`), and the
    next is dispatched before its outputs go back to the engine loop. `spec_stats`
    exposes the engine-wide counters. With it off, `spec` is None.
    """

    def __init__(self, model: LoadedModel, config: Config,
                 settings: EngineSettings | None = None) -> None:
        settings = settings or EngineSettings()
        settings.check_speculation(config.num_speculative_tokens)
        self.settings = settings
        # Decode iterations per step when the scheduler can take a burst
        # (Scheduler.from_runner reads this); warm-up compiles the burst program.
        self.decode_steps = settings.decode_steps
        sched, cache = config.scheduler_config, config.cache_config
        self.model = model
        self.config = config
        self.max_model_len = sched.max_model_len
        self.page_size = cache.page_size
        self.num_spec = config.num_speculative_tokens
        # Query tiles only help the XLA attention path; the CPU kernel groups rows
        # itself, and skipping tiles halves the programs warm-up compiles.
        self.kv_dtype = settings.cache_dtype(model.dtype)
        self.tiled_attention = not kernel_serves(self.kv_dtype)
        self.num_pages = cache.num_pages or self._pages_from_budget(settings.memory_fraction)
        self.cache_groups: CacheGroupsConfig = model.cache_groups(self.num_pages, self.page_size,
                                                                  self.kv_dtype)
        self.buckets = StepBuckets.create(sched.max_num_batched_tokens, sched.max_num_seqs,
                                          sched.max_num_seq_buckets,
                                          min_tokens=settings.min_token_bucket)
        self.max_rows = self.buckets.request_buckets[-1]
        max_pages = math.ceil(self.max_model_len / self.page_size)
        self.input_batch = InputBatch(self.max_rows, self.max_model_len,
                                      len(self.cache_groups.groups), max_pages, model.vocab_size)
        self.mesh = model.mesh
        with self.on_mesh():  # as steps are traced: see esurge/runner/real_rows.py
            self.rows_loop = one_row_at_a_time()
        kv_sharding = None if self.mesh is None else kv_cache_sharding(self.mesh)
        self.device = DeviceState(init_kv_cache(self.cache_groups, sharding=kv_sharding),
                                  replicated(jnp.zeros(self.max_rows, jnp.int32), self.mesh))
        # Request id -> its row in the last plain step's sampled tokens (async feedback).
        self.prev_index: dict[str, int] = {}
        self.prompt_logprobs = PromptLogprobsComputer(model.model_state)
        self.grammars = GrammarBatch(model.vocab_size,
                                     threaded=jax.default_backend() != "cpu")
        self.grammar_feed = GrammarFeed(self.grammars)
        # The last plain step or burst dispatched, until collected (async scheduling).
        self.last_plain: PendingStep | None = None
        self.spec: SpecDecoder | None = None
        if self.num_spec and config.speculative_config is not None:
            self.spec = SpecDecoder(model, config.speculative_config, self.cache_groups.groups,
                                    self.num_pages, self.page_size, self.max_rows,
                                    make_policy(settings.speculation))
        self.step_kinds: tuple[StepKind, ...] = self._step_kinds()
        # Moving a request's position on the host's word alone needs one host
        # (followers mirror host-known schedules) and full-attention caches
        # (a windowed cache frees pages by a position the host only bounds).
        movable = (self.spec is not None and settings.parallel_config.num_hosts == 1
                   and all(isinstance(g.spec, FullAttentionSpec)
                           for g in self.cache_groups.groups))
        # Under async scheduling a steady speculative step hands its drafts to
        # the next step at dispatch (PendingStep.ahead), which then starts where
        # the device's verification leaves each request.
        self.hands_drafts_ahead = movable and sched.async_scheduling
        # The speculative step dispatched last, until collected, if it handed drafts ahead.
        self.in_flight_spec: PendingStep | None = None
        # A request that decoded plain steps drafts again where drafting pays at
        # its batch size once the tokens its head missed are computed again
        # (SpecDecoder.resyncs).
        self.resyncs_heads = movable

    def _step_kinds(self) -> tuple[StepKind, ...]:
        """The ways this runner runs steps, in the order they are offered a step."""
        if self.spec is not None:
            return (SpeculativeStep(self, self.spec), GreedyStep(self), SampledStep(self))
        bursts = (DecodeBurstStep(self),) if self.decode_steps > 1 else ()
        return (*bursts, GreedyStep(self), SampledStep(self))

    def on_mesh(self) -> AbstractContextManager[object]:
        """The context every step is traced and run under: the model's mesh, so
        kernels that must see their own shard find it (esurge.models.local_shards)."""
        return nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    @property
    def kv_cache(self) -> KVCache:
        """The paged KV cache as the last step left it."""
        return self.device.kv_cache

    @property
    def spec_stats(self) -> SpecStatsSnapshot | None:
        """Speculative decoding counters since start (None with speculation off)."""
        return None if self.spec is None else self.spec.stats.snapshot()

    def _pages_from_budget(self, fraction: float) -> int:
        probe = self.model.cache_groups(1, self.page_size, self.kv_dtype)
        # The Eagle head's cache (usually one layer shaped like the target's)
        # spans the same page ids; budget for it too.
        page_bytes = probe.bytes_per_page
        if self.num_spec:
            page_bytes += probe.bytes_per_page // probe.group_size
        # Every device holds its kv heads' share of every page.
        page_bytes = -(-page_bytes // tp_degree(self.model.mesh))
        budget = int(_available_device_bytes() * fraction)
        sched = self.config.scheduler_config
        useful = sched.max_num_seqs * math.ceil(self.max_model_len / self.page_size) + 1
        affordable = budget // page_bytes
        # What fits the budget moves with free memory: rounded, so that a restart
        # finds its programs in the compile cache. What could be used is exact.
        pages = max(2, useful if useful <= affordable else stable_page_count(max(affordable, 1)))
        log.info("KV cache: %d pages of %d tokens (%.1f MiB, %d tokens) from %.0f%% of %.1f GiB "
                 "free memory", pages, self.page_size, pages * page_bytes / 2**20,
                 (pages - 1) * self.page_size, fraction * 100, budget / fraction / 2**30)
        return int(pages)

    def warmup(self, progress: WarmupProgress | None = None) -> float:
        """Compile every bucket now; returns the seconds it took."""
        with self.on_mesh():
            seconds = warm_up(self, progress)
            if self.spec is not None and self.spec.policy.adapts_drafts:
                began = time.perf_counter()
                self.spec.calibrate(measure_step_costs(self))
                seconds += time.perf_counter() - began
            return seconds

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step synchronously."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Apply the schedule to the persistent batch and start the step on the device."""
        started = time.perf_counter()
        with self.on_mesh():
            pending = self._dispatch(scheduler_output)
        pending.started = started
        return pending

    def _dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        self._update_batch(scheduler_output)
        # Only the step dispatched right after one that handed drafts ahead follows it.
        follows, self.in_flight_spec = self._follows(), None
        if scheduler_output.is_empty():
            return PendingStep(None)
        ib = self.input_batch
        num_spec = self.num_spec
        if (self.spec is not None and follows is None
                and not self.spec.speculates(scheduler_output)):
            num_spec = 0  # a plain step: the head's cache misses its tokens from here on
            self.spec.sync.ran_plain(self.input_batch, scheduler_output.num_scheduled_tokens,
                                     self.spec.unsynced)
        elif self.spec is not None:
            self.spec.sync.ran_speculative(scheduler_output.num_scheduled_tokens)
            if self.last_plain is not None:
                # A speculative step reads its tokens on the host, not from the
                # previous step's device output: that plain step's must be known.
                record_plain(self, self.last_plain)
        inputs = build_step_inputs(ib, scheduler_output, self.buckets, self.page_size,
                                   self.prev_index, num_spec, self.tiled_attention,
                                   None if self.spec is None else self.spec.slots.device_slot,
                                   follows,
                                   None if self.spec is None else self.spec.sync.recompute(ib))
        plan = StepPlan(inputs, ib.sampling.variant(inputs.rows),
                        self.grammars.any_in(inputs.req_ids))
        for kind in self.step_kinds:
            if kind.accepts(plan):
                pending = kind.dispatch(plan)
                if pending.ahead is not None:
                    self.in_flight_spec = pending
                return pending
        kinds = ", ".join(kind.name for kind in self.step_kinds)
        raise ValueError(f"no step kind of this runner ({kinds}) runs a step of "
                         f"{inputs.num_steps} iterations")

    def _update_batch(self, so: SchedulerOutput) -> None:
        gone = self.input_batch.apply(so)
        self.grammars.remove(gone)
        self.prompt_logprobs.release(so.finished_req_ids)
        if self.spec is not None:
            self.spec.release(gone)
        for new in so.scheduled_new_reqs:
            if self.spec is not None:
                self.spec.admit(new)
            if new.grammar is not None:
                self.grammars.add(new.req_id, new.grammar, _stop_ids(new),
                                  new.output_token_ids)

    def _follows(self) -> dict[str, int] | None:
        """The rows of the speculative step in flight that handed its drafts
        ahead, by request (None: no such step): the next step follows it."""
        step = self.in_flight_spec
        if step is None or step.inputs is None:
            return None
        return {req_id: i for i, req_id in enumerate(step.inputs.req_ids)}

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a dispatched step; record and return its sampled tokens."""
        if self.last_plain is pending:
            self.last_plain = None
        if self.in_flight_spec is pending:
            self.in_flight_spec = None
        if pending.kind is None:
            return ModelRunnerOutput.empty()
        with self.on_mesh():
            out = pending.kind.collect(pending)
        if self.spec is not None and pending.inputs is not None:
            self.spec.observe_step(pending.inputs, out, pending.started)
        return out

    def pipelines(self, pending: PendingStep) -> bool:
        """Whether the next step may be scheduled before this one is collected
        (not after a speculative step, unless it handed its drafts ahead: see
        StepKind.pipelined)."""
        if pending.kind is None or pending.ahead is not None:
            return True
        # A request to compute again can move back only with no step in flight.
        return pending.kind.pipelined and not self.resyncs()

    def resyncs(self) -> dict[str, int]:
        """Requests whose head's cache stops short (they decoded plain steps) to
        compute again from there, where drafting pays at the batch's size."""
        if self.spec is None or not self.resyncs_heads:
            return {}
        return self.spec.resyncs(self.input_batch)

    def rewound(self, computed: Mapping[str, int]) -> None:
        """The requests the scheduler moved back to where their head's cache
        stops, with how far each had computed."""
        if self.spec is not None:
            self.spec.sync.moved(computed, self.spec.unsynced)

    def drafts_ahead(self, pending: PendingStep) -> dict[str, Sequence[int]]:
        """The drafts a dispatched step proposed for the next, by request, when it
        pipelines with them (the scheduler takes them before it is read)."""
        return pending.ahead or {}

    def sampler_variants(self) -> list[SamplerVariant]:
        """Every sampler variant a batch can need (compiled at warm-up)."""
        return [SamplerVariant(greedy, dense, logprobs) for greedy in (True, False)
                for dense in (False, True) for logprobs in (False, True)]
