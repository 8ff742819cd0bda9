"""Decode bursts: K decode iterations of the whole batch in one device call.

The scheduler plans a burst only when every running request decodes with
stateless sampling (`SamplingParams.stateless_sampling`); the kind refuses
anything else rather than sample it wrongly.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from esurge.models.kv_cache import NULL_PAGE
from esurge.outputs import ModelRunnerOutput
from esurge.runner.device_step import decode_burst_step
from esurge.runner.packed_inputs import pack_inputs
from esurge.runner.sampler import SamplerOutput, SamplerVariant
from esurge.runner.steps.base import PendingStep, Program, StepPlan, WarmupPlan
from esurge.runner.steps.padding import padding_batch
from esurge.runner.steps.plain import collect_plain, sampling_tensors

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["DecodeBurstStep"]


class DecodeBurstStep:
    """A burst of `runner.decode_steps` plain decode iterations."""

    name = "decode burst"
    pipelined = True

    def __init__(self, runner: eSurgeRunner) -> None:
        self.runner = runner

    def accepts(self, plan: StepPlan) -> bool:
        return plan.inputs.num_steps > 1

    def dispatch(self, plan: StepPlan) -> PendingStep:
        runner, inputs, variant = self.runner, plan.inputs, plan.variant
        if variant.dense or variant.logprobs or plan.constrained:
            raise ValueError("a decode burst was scheduled for requests whose sampling "
                             "keeps per-token state (SamplingParams.stateless_sampling)")
        device = runner.device
        flat, layout = pack_inputs(inputs.batch, inputs.prev_index, inputs.burst_slots)
        tensors = None if variant.all_greedy else sampling_tensors(runner, inputs, variant)
        tokens, device.kv_cache, device.prev_tokens = decode_burst_step(
            runner.model.model_state, device.kv_cache, flat, device.prev_tokens, tensors,
            layout, variant)
        runner.prev_index = {rid: i for i, rid in enumerate(inputs.req_ids)}
        pending = runner.last_plain = PendingStep(self, inputs, SamplerOutput(token_ids=tokens))
        return pending

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        return collect_plain(self.runner, pending)

    def programs(self, plan: WarmupPlan) -> list[Program]:
        """A burst lands in the buckets of one token per request, greedy or sampled."""
        runner, buckets = self.runner, self.runner.buckets
        most = min(runner.max_rows, buckets.token_buckets[-1])
        wanted = {(buckets.tokens_for(n), buckets.requests_for(n)) for n in range(1, most + 1)}
        return [Program(f"decode burst tokens={t} requests={r} steps={runner.decode_steps} "
                        f"greedy={greedy}",
                        partial(self._compile, t, r, SamplerVariant(greedy)))
                for t, r in sorted(wanted.intersection(plan.shapes)) for greedy in (True, False)]

    def _compile(self, tokens: int, requests: int, variant: SamplerVariant) -> object:
        runner, device = self.runner, self.runner.device
        groups = len(runner.cache_groups.groups)
        later = np.full((runner.decode_steps - 1, groups, tokens), NULL_PAGE * runner.page_size,
                        np.int32)
        flat, layout = pack_inputs(padding_batch(runner, tokens, requests),
                                   np.full(tokens, -1, np.int32), later)
        tensors = None if variant.all_greedy else runner.input_batch.sampling.tensors(
            np.zeros(0, np.int64), requests, np.zeros(0, np.int32), variant)
        out, device.kv_cache, _ = decode_burst_step(
            runner.model.model_state, device.kv_cache, flat, device.prev_tokens, tensors,
            layout, variant)
        return out
