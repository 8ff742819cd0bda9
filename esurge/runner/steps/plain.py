"""Plain steps: one model forward, then either its own argmax or the sampler.

`GreedyStep` serves batches whose every row decodes greedily with no
per-token state and no grammar: the model step's argmax is the sample, and
no sampling call runs. `SampledStep` serves every other single step: the
model step is queued, the grammar masks are built on the host while it
runs, then the sampler. Both share the model-step program and the collect.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING

import jax
import numpy as np

from esurge.outputs import ModelRunnerOutput, TokenLogprobs
from esurge.runner.device_step import model_step, sample_step, sampled_logprobs_step
from esurge.runner.host_read import to_host
from esurge.runner.packed_inputs import pack_inputs
from esurge.runner.sampler import SamplerOutput, SamplerVariant, SamplingTensors
from esurge.runner.step_inputs import StepInputs
from esurge.runner.steps.base import PendingStep, Program, StepPlan, WarmupPlan
from esurge.runner.steps.padding import padding_batch, with_tiles
from esurge.structured_output.batch import GrammarBatch

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["GrammarFeed", "GreedyStep", "SampledStep", "collect_plain", "record_plain"]

PLAIN_GREEDY = SamplerVariant()  # greedy rows only, no penalties or masks, no logprobs


class GrammarFeed:
    """Feeds plain steps' sampled tokens to the matchers, as early as a mask needs them.

    With async scheduling the previous step's tokens are still on the device
    when the next step's masks are built; `masks` reads them first.
    """

    def __init__(self, grammars: GrammarBatch) -> None:
        self.grammars = grammars
        self.last: PendingStep | None = None

    def observe(self, pending: PendingStep) -> None:
        """Advance the constrained requests' matchers by the step's tokens (once)."""
        inputs, sampled = pending.inputs, pending.sampled
        if self.last is pending:
            self.last = None
        if pending.grammar_seen or inputs is None or sampled is None:
            return
        pending.grammar_seen = True
        if inputs.num_steps > 1 or not self.grammars.any_in(inputs.req_ids):
            return
        tokens = to_host(sampled.token_ids)
        for i, req_id in enumerate(inputs.req_ids):
            if inputs.samples[i]:
                self.grammars.advance(req_id, int(inputs.sample_positions[i]), [int(tokens[i])])

    def masks(self, inputs: StepInputs, constrained: bool, rows: int) -> np.ndarray:
        """[rows, words] int32 token masks for a step's sampler."""
        if not constrained:
            return self.grammars.all_allowed(rows)
        if self.last is not None:
            self.observe(self.last)
        return self.grammars.masks(inputs.req_ids, inputs.samples, rows)


def sampling_tensors(runner: eSurgeRunner, inputs: StepInputs, variant: SamplerVariant,
                     rows: int | None = None) -> SamplingTensors:
    """The scheduled rows' sampling tensors, padded to `rows` (default: the
    step's request bucket)."""
    return runner.input_batch.sampling.tensors(
        inputs.rows, inputs.num_reqs_bucket if rows is None else rows,
        inputs.sample_positions, variant)


def sampler_rows(runner: eSurgeRunner, requests: int, variant: SamplerVariant) -> int:
    """The plain sampler's rows for a step in this request bucket.

    Where the sampler loops over real rows (real_rows), padding rows cost it
    nothing, so it takes the model step's whole logits (StepBuckets.model_requests)
    and request buckets below the floor share its program; a dense variant keeps
    its bucket, its [rows, vocabulary] tensors being built on the host.
    """
    if variant.dense or not runner.rows_loop:
        return requests
    return runner.buckets.model_requests(requests)


def run_model_step(runner: eSurgeRunner, inputs: StepInputs
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queue the forward: (logits [L, V], final hidden [T, H], greedy tokens [max_rows])."""
    device = runner.device
    flat, layout = pack_inputs(inputs.batch, inputs.prev_index, inputs.burst_slots)
    logits, hidden, device.kv_cache, greedy = model_step(
        runner.model.model_state, device.kv_cache, flat, device.prev_tokens, layout)
    return logits, hidden, greedy


def _pending(runner: eSurgeRunner, kind: GreedyStep | SampledStep, plan: StepPlan,
             sampled: SamplerOutput, hidden: jax.Array) -> PendingStep:
    inputs = plan.inputs
    ib = runner.input_batch
    runner.prev_index = {rid: i for i, rid in enumerate(inputs.req_ids)}
    plp = runner.prompt_logprobs.compute(ib, inputs, hidden)
    wanted = ib.sampling.num_logprobs[inputs.rows].copy() if plan.variant.logprobs else None
    pending = PendingStep(kind, inputs, sampled, plp, num_logprobs=wanted)
    runner.grammar_feed.last = runner.last_plain = pending
    return pending


def _model_step_programs(runner: eSurgeRunner, plan: WarmupPlan) -> list[Program]:
    """The model step in every token bucket, model request dimension
    (StepBuckets.model_requests) and tile; its outputs feed the later programs
    (the logits go to every request bucket padded to that dimension)."""
    if not plan.first_listing("model step"):
        return []
    model_requests = runner.buckets.model_requests
    shapes = list(dict.fromkeys((t, model_requests(r)) for t, r in plan.shapes))

    def compile_one(tokens: int, requests: int, tile: int) -> jax.Array:
        flat, layout = pack_inputs(padding_batch(runner, tokens, requests, tile=tile),
                                   np.full(tokens, -1, np.int32))
        device = runner.device
        logits, hidden, device.kv_cache, _ = model_step(
            runner.model.model_state, device.kv_cache, flat, device.prev_tokens, layout)
        plan.hidden_of[tokens] = hidden
        for r in plan.request_buckets:
            if model_requests(r) == requests:
                plan.logits_of[r] = logits
        return logits

    return [Program(f"model step tokens={t} requests={r} tile={tile}",
                    partial(compile_one, t, r, tile))
            for t, r, tile in with_tiles(shapes, runner.tiled_attention)]


def record_plain(runner: eSurgeRunner, pending: PendingStep) -> np.ndarray | None:
    """A plain step's or burst's sampled tokens, [K, >= R] (K = 1 for a plain step),
    read to the host and written into the persistent batch once: at collect, or
    before a step that cannot take them from the device (a speculative one)."""
    inputs, sampled = pending.inputs, pending.sampled
    if pending.host_tokens is None and inputs is not None and sampled is not None:
        runner.grammar_feed.observe(pending)
        tokens = to_host(sampled.token_ids)
        if inputs.num_steps == 1:
            tokens = tokens[None]
        runner.input_batch.record_sampled(inputs.req_ids, inputs.samples, inputs.seq_lens,
                                          tokens)
        pending.host_tokens = tokens
    return pending.host_tokens


def collect_plain(runner: eSurgeRunner, pending: PendingStep) -> ModelRunnerOutput:
    """Wait for a plain step or a decode burst; record and return its sampled tokens."""
    inputs, sampled = pending.inputs, pending.sampled
    tokens = record_plain(runner, pending)
    if inputs is None or sampled is None or tokens is None:
        return ModelRunnerOutput.empty()
    n = len(inputs.req_ids)
    if inputs.num_steps > 1:  # [K, R]: every request samples each iteration
        sampled_ids = tokens[:, :n].T.tolist()
    else:
        sampled_ids = [[token] if sampled_row else [] for token, sampled_row
                       in zip(tokens[0, :n].tolist(), inputs.samples.tolist(), strict=True)]
    return ModelRunnerOutput(
        req_ids=inputs.req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(inputs.req_ids)},
        sampled_token_ids=sampled_ids,
        logprobs=_logprobs(inputs, sampled, pending.num_logprobs),
        prompt_logprobs=pending.prompt_logprobs,
    )


def _logprobs(inputs: StepInputs, sampled: SamplerOutput, wanted: np.ndarray | None
              ) -> list[list[TokenLogprobs] | None] | None:
    if (wanted is None or sampled.logprobs is None or sampled.logprob_token_ids is None
            or sampled.ranks is None):
        return None
    ids, lps = to_host(sampled.logprob_token_ids), to_host(sampled.logprobs)
    ranks = to_host(sampled.ranks)
    out: list[list[TokenLogprobs] | None] = []
    for i in range(len(inputs.req_ids)):
        n = int(wanted[i])
        if n < 0 or not inputs.samples[i]:
            out.append(None)
            continue
        out.append([TokenLogprobs.from_row(ids[i], lps[i], ranks[i], n)])
    return out


class GreedyStep:
    """A plain greedy batch: the model step's argmax is the sample."""

    name = "greedy"
    pipelined = True

    def __init__(self, runner: eSurgeRunner) -> None:
        self.runner = runner

    def accepts(self, plan: StepPlan) -> bool:
        return (plan.inputs.num_steps == 1 and plan.variant == PLAIN_GREEDY
                and not plan.constrained)

    def dispatch(self, plan: StepPlan) -> PendingStep:
        _, hidden, greedy = run_model_step(self.runner, plan.inputs)
        self.runner.device.prev_tokens = greedy
        return _pending(self.runner, self, plan, SamplerOutput(token_ids=greedy), hidden)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        return collect_plain(self.runner, pending)

    def programs(self, plan: WarmupPlan) -> list[Program]:
        return _model_step_programs(self.runner, plan)


class SampledStep:
    """Any other single step: the model step, then the sampler over masked logits."""

    name = "sampled"
    pipelined = True

    def __init__(self, runner: eSurgeRunner) -> None:
        self.runner = runner

    def accepts(self, plan: StepPlan) -> bool:
        return plan.inputs.num_steps == 1

    def dispatch(self, plan: StepPlan) -> PendingStep:
        runner, inputs = self.runner, plan.inputs
        logits, hidden, _ = run_model_step(runner, inputs)
        if plan.variant.dense and runner.last_plain is not None:
            # Penalties, bad words and min_tokens count every token so far; under
            # async scheduling the previous step's are still on the device.
            record_plain(runner, runner.last_plain)
        # The model step is queued: the masks are built while it runs.
        rows = sampler_rows(runner, inputs.num_reqs_bucket, plan.variant)
        tensors = dataclasses.replace(
            sampling_tensors(runner, inputs, plan.variant, rows),
            allowed=runner.grammar_feed.masks(inputs, plan.constrained, rows))
        sampled, runner.device.prev_tokens = sample_step(
            logits, tensors, np.int32(len(inputs.req_ids)), _without_logprobs(plan.variant),
            runner.max_rows)
        if plan.variant.logprobs:
            ids, lps, ranks = sampled_logprobs_step(logits, tensors.allowed, sampled.token_ids,
                                                    np.int32(len(inputs.req_ids)))
            sampled = sampled.replace(logprob_token_ids=ids, logprobs=lps, ranks=ranks)
        return _pending(runner, self, plan, sampled, hidden)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        return collect_plain(self.runner, pending)

    def programs(self, plan: WarmupPlan) -> list[Program]:
        runner = self.runner
        sampling = runner.input_batch.sampling

        tokens_of: dict[int, jax.Array] = {}  # a sampler program's tokens, by its rows

        def compile_one(requests: int, rows: int, variant: SamplerVariant) -> object:
            tensors = sampling.tensors(np.zeros(0, np.int64), rows, np.zeros(0, np.int32),
                                       variant)
            tensors = dataclasses.replace(tensors, allowed=runner.grammars.all_allowed(rows))
            out = sample_step(plan.logits_of[requests], tensors, np.int32(rows), variant,
                              runner.max_rows)
            tokens_of[rows] = out[0].token_ids
            return out

        def compile_logprobs(requests: int, rows: int) -> object:
            return sampled_logprobs_step(plan.logits_of[requests],
                                         runner.grammars.all_allowed(rows), tokens_of[rows],
                                         np.int32(rows))

        variants = list(dict.fromkeys(_without_logprobs(v) for v in plan.variants))
        samplers = {(sampler_rows(runner, r, v), v): r
                    for r in plan.request_buckets for v in variants}
        programs = [Program(f"sampler requests={rows} {v}", partial(compile_one, r, rows, v))
                    for (rows, v), r in samplers.items()]
        if any(v.logprobs for v in plan.variants):
            logprob_rows = {rows: r for (rows, _), r in samplers.items()}
            programs += [Program(f"sampled logprobs requests={rows}",
                                 partial(compile_logprobs, r, rows))
                         for rows, r in logprob_rows.items()]
        return _model_step_programs(runner, plan) + programs


def _without_logprobs(variant: SamplerVariant) -> SamplerVariant:
    """The sampler program's variant: logprobs come from their own program
    (sampled_logprobs_step), so each variant compiles once, not twice."""
    return dataclasses.replace(variant, logprobs=False)
