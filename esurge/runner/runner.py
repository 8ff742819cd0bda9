"""eSurgeRunner: turns each SchedulerOutput into one jitted model step.

The runner keeps the persistent batch on the host, builds each step's inputs
with numpy (one transfer per step), pads them to precompiled (tokens,
requests) buckets and runs the model and the sampler on the device. With
async scheduling the next step is dispatched before the previous one's tokens
reach the host: those inputs are read on the device from the previous
sampler output.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from esurge.config import Config
from esurge.core.kv_cache_spec import CacheGroupsConfig
from esurge.models.kv_cache import KVCache, init_kv_cache
from esurge.models.loader import LoadedModel
from esurge.models.paged_attention import kernel_serves
from esurge.outputs import ModelRunnerOutput, TokenLogprobs
from esurge.runner.buckets import StepBuckets
from esurge.runner.device_step import decode_burst_step, model_step, sample_step
from esurge.runner.input_batch import InputBatch
from esurge.runner.packed_inputs import pack_inputs
from esurge.runner.prompt_logprobs import PromptLogprobsComputer
from esurge.runner.sampler import SamplerOutput, SamplerVariant, SamplingTensors
from esurge.runner.spec_decoder import SpecDecoder, SpecStep
from esurge.runner.step_inputs import StepInputs, build_step_inputs
from esurge.runner.warmup import warm_up
from esurge.scheduler.decode_burst import check_decode_steps
from esurge.scheduler.output import NewRequestData, SchedulerOutput
from esurge.spec_decode.stats import SpecStatsSnapshot
from esurge.structured_output.batch import GrammarBatch

__all__ = ["WarmupProgress", "eSurgeRunner"]

log = logging.getLogger(__name__)

_PLAIN_GREEDY = SamplerVariant()  # greedy rows only, no penalties or masks, no logprobs

WarmupProgress = Callable[[int, int, str], None]


@dataclass(slots=True)
class _Pending:
    """A dispatched step: its host inputs and its device results."""

    inputs: StepInputs | None
    sampled: SamplerOutput | None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]
    tokens: np.ndarray | None = None  # host copy once collected
    spec: SpecStep | None = None
    # Logprobs wanted per scheduled request, read at dispatch: by collect the
    # next step's batch update may have compacted the rows (async scheduling).
    num_logprobs: np.ndarray | None = None
    # The grammar matchers have seen this step's tokens (read early when the
    # next step's masks needed them).
    grammar_seen: bool = False


def _stop_ids(new: NewRequestData) -> tuple[int, ...]:
    """The tokens that end a request (and that its grammar allows where it accepts)."""
    params = new.sampling_params
    eos = () if new.eos_token_id is None or params.ignore_eos else (new.eos_token_id,)
    return tuple(params.stop_token_ids) + eos


def _available_host_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _available_device_bytes() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
    return int(limit - used) if limit else _available_host_bytes()


class eSurgeRunner:
    """Runs scheduled steps of one loaded model over a paged KV cache.

    With `config.speculative_config` enabling Eagle, `spec` holds the draft
    head and each step verifies and proposes drafts (steps then run
    synchronously); `spec_stats` exposes the engine-wide counters. With it
    off, `spec` is None and the step is exactly the plain one.
    """

    def __init__(self, model: LoadedModel, config: Config, *, memory_fraction: float = 0.25,
                 min_token_bucket: int = 16, decode_steps: int = 1) -> None:
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        # Decode iterations per step when the scheduler can take a burst
        # (Scheduler.from_runner reads this); warm-up compiles the burst program.
        self.decode_steps = check_decode_steps(decode_steps, config.num_speculative_tokens)
        sched, cache = config.scheduler_config, config.cache_config
        self.model = model
        self.config = config
        self.hf_config: Any = model.hf_config
        self.max_model_len = sched.max_model_len
        self.kv_dtype = model.dtype
        self.page_size = cache.page_size
        self.num_spec = config.num_speculative_tokens
        # Query tiles only help the XLA attention path; the CPU kernel groups rows
        # itself, and skipping tiles halves the programs warm-up compiles.
        self.tiled_attention = not kernel_serves(model.dtype)
        self.num_pages = cache.num_pages or self._pages_from_budget(memory_fraction)
        self.cache_groups: CacheGroupsConfig = model.cache_groups(self.num_pages, self.page_size)
        self.kv_cache: KVCache = init_kv_cache(self.cache_groups)
        self.buckets = StepBuckets.create(sched.max_num_batched_tokens, sched.max_num_seqs,
                                          sched.max_num_seq_buckets, min_tokens=min_token_bucket)
        self.max_rows = self.buckets.request_buckets[-1]
        max_pages = math.ceil(self.max_model_len / self.page_size)
        self.input_batch = InputBatch(self.max_rows, self.max_model_len,
                                      len(self.cache_groups.groups), max_pages, model.vocab_size)
        self._prev_tokens = jnp.zeros(self.max_rows, jnp.int32)
        self._prev_index: dict[str, int] = {}
        self._prompt_logprobs = PromptLogprobsComputer(model.model_state)
        self.grammars = GrammarBatch(model.vocab_size)
        self._all_allowed: dict[int, np.ndarray] = {}
        self._last_pending: _Pending | None = None
        self.spec: SpecDecoder | None = None
        if self.num_spec and config.speculative_config is not None:
            if sched.async_scheduling:
                raise ValueError("speculative steps run synchronously: build the runner with "
                                 "async_scheduling=False (eSurge does this for you)")
            self.spec = SpecDecoder(model, config.speculative_config, self.cache_groups.groups,
                                    self.num_pages, self.page_size, self.max_rows)

    @property
    def spec_stats(self) -> SpecStatsSnapshot | None:
        """Speculative decoding counters since start (None with speculation off)."""
        return None if self.spec is None else self.spec.stats.snapshot()

    def _pages_from_budget(self, fraction: float) -> int:
        probe = self.model.cache_groups(1, self.page_size)
        # The Eagle head's cache (usually one layer shaped like the target's)
        # spans the same page ids; budget for it too.
        page_bytes = probe.bytes_per_page
        if self.num_spec:
            page_bytes += probe.bytes_per_page // probe.group_size
        budget = int(_available_device_bytes() * fraction)
        sched = self.config.scheduler_config
        useful = sched.max_num_seqs * math.ceil(self.max_model_len / self.page_size) + 1
        pages = max(2, min(budget // page_bytes, useful))
        log.info("KV cache: %d pages of %d tokens (%.1f MiB, %d tokens) from %.0f%% of %.1f GiB "
                 "free memory", pages, self.page_size, pages * page_bytes / 2**20,
                 (pages - 1) * self.page_size, fraction * 100, budget / fraction / 2**30)
        return int(pages)

    def warmup(self, progress: WarmupProgress | None = None) -> float:
        """Compile every bucket now; returns the seconds it took."""
        return warm_up(self, progress)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step synchronously."""
        return self.collect(self.dispatch(scheduler_output))

    def dispatch(self, scheduler_output: SchedulerOutput) -> _Pending:
        """Apply the schedule to the persistent batch and start the step on the device."""
        self._update_batch(scheduler_output)
        if scheduler_output.is_empty():
            return _Pending(None, None, {})
        ib = self.input_batch
        inputs = build_step_inputs(ib, scheduler_output, self.buckets, self.page_size,
                                   self._prev_index, self.num_spec, self.tiled_attention)
        variant = ib.sampling.variant(inputs.rows)

        def tensors() -> SamplingTensors:
            return ib.sampling.tensors(inputs.rows, inputs.num_reqs_bucket,
                                       inputs.sample_positions, variant)

        if self.spec is not None:
            spec_tensors = dataclasses.replace(tensors(), allowed=self._spec_masks(inputs))
            hidden, self.kv_cache, spec_step = self.spec.run(
                self.model.model_state, self.kv_cache, ib, inputs, spec_tensors, variant)
            plp = self._prompt_logprobs.compute(ib, inputs, hidden)
            return _Pending(inputs, None, plp, spec=spec_step)
        flat, layout = pack_inputs(inputs.batch, inputs.prev_index, inputs.burst_slots)
        if inputs.num_steps > 1:
            if variant.dense or variant.logprobs:
                raise ValueError("a decode burst was scheduled for requests whose sampling "
                                 "keeps per-token state (SamplingParams.stateless_sampling)")
            tokens, self.kv_cache, self._prev_tokens = decode_burst_step(
                self.model.model_state, self.kv_cache, flat, self._prev_tokens,
                None if variant.all_greedy else tensors(), layout, variant)
            self._prev_index = {rid: i for i, rid in enumerate(inputs.req_ids)}
            return _Pending(inputs, SamplerOutput(token_ids=tokens), {})
        logits, hidden, self.kv_cache, greedy = model_step(
            self.model.model_state, self.kv_cache, flat, self._prev_tokens, layout)
        constrained = self.grammars.any_in(inputs.req_ids)
        if variant == _PLAIN_GREEDY and not constrained:  # the model step's argmax is the sample
            sampled, self._prev_tokens = SamplerOutput(token_ids=greedy), greedy
        else:
            # The model step is queued: the masks are built while it runs.
            masked = dataclasses.replace(tensors(), allowed=self._step_masks(inputs, constrained))
            sampled, self._prev_tokens = sample_step(logits, masked, variant, self.max_rows)
        self._prev_index = {rid: i for i, rid in enumerate(inputs.req_ids)}
        plp = self._prompt_logprobs.compute(ib, inputs, hidden)
        wanted = ib.sampling.num_logprobs[inputs.rows].copy() if variant.logprobs else None
        self._last_pending = _Pending(inputs, sampled, plp, num_logprobs=wanted)
        return self._last_pending

    def all_allowed(self, rows: int) -> np.ndarray:
        """[rows, words] int32 masks allowing every token (shared, read-only)."""
        mask = self._all_allowed.get(rows)
        if mask is None:
            mask = np.full((rows, self.grammars.words), -1, np.int32)
            mask.flags.writeable = False
            self._all_allowed[rows] = mask
        return mask

    def _step_masks(self, inputs: StepInputs, constrained: bool) -> np.ndarray:
        if not constrained:
            return self.all_allowed(inputs.num_reqs_bucket)
        # With async scheduling the previous step's tokens are still on the
        # device; this step's masks depend on them.
        if self._last_pending is not None:
            self._observe_grammar(self._last_pending)
        return self.grammars.masks(inputs.req_ids, inputs.samples, inputs.num_reqs_bucket)

    def _spec_masks(self, inputs: StepInputs) -> np.ndarray:
        rows = inputs.num_reqs_bucket * (1 + self.num_spec)
        if self.spec is None or not self.grammars.any_in(inputs.req_ids):
            return self.all_allowed(rows)
        drafts, num_drafts, _ = self.spec.scheduled_drafts(self.input_batch, inputs)
        return self.grammars.draft_masks(inputs.req_ids, inputs.samples, drafts, num_drafts)

    def _observe_grammar(self, pending: _Pending) -> None:
        """Feed a plain step's sampled tokens to the matchers of its constrained requests."""
        inputs, sampled = pending.inputs, pending.sampled
        if pending.grammar_seen or inputs is None or sampled is None:
            return
        pending.grammar_seen = True
        if inputs.num_steps > 1 or not self.grammars.any_in(inputs.req_ids):
            return
        tokens = np.asarray(sampled.token_ids)
        for i, req_id in enumerate(inputs.req_ids):
            if inputs.samples[i]:
                self.grammars.advance(req_id, int(inputs.sample_positions[i]), [int(tokens[i])])

    def _update_batch(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        gone = so.finished_req_ids | so.preempted_req_ids
        gone.update(new.req_id for new in so.scheduled_new_reqs if new.req_id in ib.row_of)
        ib.remove(gone)
        self.grammars.remove(gone)
        if self.spec is not None:
            self.spec.release(gone)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            row = ib.row_of[req_id]
            pages = cached.new_page_ids[i]
            if pages is not None:
                ib.append_pages(row, pages)
            ib.num_computed[row] = cached.num_computed_tokens[i]
        for new in so.scheduled_new_reqs:
            ib.add(new)
            if new.grammar is not None:
                self.grammars.add(new.req_id, new.grammar, _stop_ids(new),
                                  new.output_token_ids)

    def collect(self, pending: _Pending) -> ModelRunnerOutput:
        """Wait for a dispatched step; record and return its sampled tokens."""
        inputs, sampled = pending.inputs, pending.sampled
        if inputs is not None and pending.spec is not None and self.spec is not None:
            return self._collect_spec(inputs, pending.spec, pending.prompt_logprobs)
        if inputs is None or sampled is None:
            return ModelRunnerOutput.empty()
        self._observe_grammar(pending)
        if self._last_pending is pending:
            self._last_pending = None
        tokens = np.asarray(sampled.token_ids)
        n = len(inputs.req_ids)
        if inputs.num_steps > 1:  # [K, R]: every request samples each iteration
            sampled_ids = tokens[:, :n].T.tolist()
        else:
            sampled_ids = [[token] if sampled_row else [] for token, sampled_row
                           in zip(tokens[:n].tolist(), inputs.samples.tolist(), strict=True)]
            tokens = tokens[None]
        self.input_batch.record_sampled(inputs.req_ids, inputs.samples, inputs.seq_lens, tokens)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(inputs.req_ids)},
            sampled_token_ids=sampled_ids,
            logprobs=self._logprobs(inputs, sampled, pending.num_logprobs),
            prompt_logprobs=pending.prompt_logprobs,
        )

    def _collect_spec(self, inputs: StepInputs, step: SpecStep,
                      prompt_logprobs: dict[str, list[TokenLogprobs | None]]
                      ) -> ModelRunnerOutput:
        if self.spec is None:
            raise ValueError("a speculative step was collected by a runner without speculation")
        ib = self.input_batch
        emitted, proposals = self.spec.finish(ib, inputs, step)
        for i, req_id in enumerate(inputs.req_ids):
            if emitted[i] and req_id in self.grammars:
                self.grammars.advance(req_id, int(inputs.sample_positions[i]), emitted[i])
                # Drafts the grammar refuses would be rejected: not worth verifying.
                proposals[i] = self.grammars.valid_drafts(req_id, proposals[i])
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(inputs.req_ids)},
            sampled_token_ids=emitted,
            spec_token_ids=proposals,
            logprobs=self.spec.logprobs(inputs, step.verified, ib.sampling.num_logprobs),
            prompt_logprobs=prompt_logprobs,
        )

    @staticmethod
    def _logprobs(inputs: StepInputs, sampled: SamplerOutput, wanted: np.ndarray | None
                  ) -> list[list[TokenLogprobs] | None] | None:
        if (wanted is None or sampled.logprobs is None or sampled.logprob_token_ids is None
                or sampled.ranks is None):
            return None
        ids, lps = np.asarray(sampled.logprob_token_ids), np.asarray(sampled.logprobs)
        ranks = np.asarray(sampled.ranks)
        out: list[list[TokenLogprobs] | None] = []
        for i in range(len(inputs.req_ids)):
            n = int(wanted[i])
            if n < 0 or not inputs.samples[i]:
                out.append(None)
                continue
            out.append([TokenLogprobs.from_row(ids[i], lps[i], ranks[i], n)])
        return out

    def sampler_variants(self) -> list[SamplerVariant]:
        """Every sampler variant a batch can need (compiled at warm-up)."""
        return [SamplerVariant(greedy, dense, logprobs) for greedy in (True, False)
                for dense in (False, True) for logprobs in (False, True)]
