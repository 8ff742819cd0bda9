"""The speculative step: target forward over [last token + drafts], verification, proposal.

With Eagle on, a step is one of these where the runner's speculation policy
says drafting pays, or drafts wait for verification; the others are plain
steps. How many drafts a step accepts moves every later position, so under
async scheduling a speculative step pipelines only when it is steady (every
request decodes, with neither a grammar nor per-token sampling state, and
drafts again with room for all its drafts): it then hands
its proposals to the scheduler at dispatch (PendingStep.ahead), and the next
step, scheduled before this one is read, verifies them laid out as if every
draft in flight were accepted; the device moves each request back over the
ones its verification rejected (device_step.follow_in_flight). Any other
speculative step is collected before the next is scheduled, but collecting
waits for its verification only, not for its proposals: the next step is
scheduled and dispatched while the device still drafts, reads those drafts
on the device, and is queued before the outputs go back to the loop. The
plain steps of the same engine overlap as in any other. One
dispatched behind a plain step still in flight first reads that step's
tokens to the host. A constrained request's drafts are drawn under its
grammar's masks (`masked.py`, on the host) and verified under the masks its
grammar gives after each draft.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING

import jax
import numpy as np

from esurge.outputs import ModelRunnerOutput
from esurge.runner.sampler import SamplerVariant
from esurge.runner.step_inputs import StepInputs
from esurge.runner.steps.base import PendingStep, Program, StepPlan, WarmupPlan
from esurge.runner.steps.padding import padding_inputs, with_tiles
from esurge.runner.steps.plain import sampling_tensors
from esurge.runner.steps.speculative.decoder import SpecDecoder, SpecStep
from esurge.runner.steps.speculative.draft_inputs import allowed_count
from esurge.runner.steps.speculative.draft_slots import ReadOnce
from esurge.runner.steps.speculative.masked import masked_proposals, warm_masked_step
from esurge.runner.steps.speculative.verify import emitted_logprobs, verify_jit

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["SpeculativeStep"]


class SpeculativeStep:
    """Every step of a runner with an Eagle head."""

    name = "speculative"
    pipelined = False

    def __init__(self, runner: eSurgeRunner, spec: SpecDecoder) -> None:
        self.runner = runner
        self.spec = spec

    def accepts(self, plan: StepPlan) -> bool:
        return plan.inputs.num_steps == 1 and plan.inputs.num_spec > 0

    def dispatch(self, plan: StepPlan) -> PendingStep:
        runner, inputs = self.runner, plan.inputs
        tensors = dataclasses.replace(sampling_tensors(runner, inputs, plan.variant),
                                      allowed=self._masks(inputs, plan.constrained))
        device, grammars = runner.device, runner.grammars
        grammar_rows = (np.fromiter((rid in grammars for rid in inputs.req_ids), bool,
                                    len(inputs.req_ids)) if plan.constrained else None)
        hidden, device.kv_cache, step = self.spec.run(
            runner.model.model_state, device.kv_cache, runner.input_batch, inputs, tensors,
            plan.variant, grammar_rows=grammar_rows)
        plp = runner.prompt_logprobs.compute(runner.input_batch, inputs, hidden)
        # Read now: by collect the next step's batch update may have moved the rows.
        pending = PendingStep(self, inputs, None, plp, extra=step,
                              num_logprobs=runner.input_batch.sampling.num_logprobs[inputs.rows])
        if (runner.hands_drafts_ahead and not plp and step.drafts is not None
                and step.slots is not None and self._steady(plan, step)):
            drafts, slots, kept = ReadOnce(step.drafts), self.spec.slots, step.slots
            pending.ahead = {
                req_id: slots.on_device(int(kept[i]), step.generation, step.count, drafts, i)
                for i, req_id in enumerate(inputs.req_ids)}
        return pending

    def _steady(self, plan: StepPlan, step: SpecStep) -> bool:
        """Whether the next step can be scheduled before this one is read: every
        request decodes, with no per-token host state (a dense sampler) nor
        grammar, and drafts again (the next step verifies those drafts where
        this one's verification leaves each request, which only the device
        knows until then; random draws are keyed by the moved positions)."""
        inputs, variant = plan.inputs, plan.variant
        num_reqs = len(inputs.req_ids)
        return (not variant.dense and not plan.constrained
                and step.count >= 1 and bool(step.propose.all())
                and bool(inputs.samples.all())
                and inputs.num_tokens == num_reqs + int(inputs.num_drafts.sum())
                and self.spec.policy.speculate(num_reqs) and self._room(inputs, step.count))

    def _room(self, inputs: StepInputs, count: int) -> bool:
        """Whether every request keeps all `count` drafts however many of this
        step's it accepts (allowed_count), as a step read first would give it:
        near max_tokens or max_model_len the next step waits for this one."""
        ib = self.runner.input_batch
        return all(allowed_count(ib, ib.row_of[req_id], int(inputs.seq_lens[i]) + 1, count)
                   == count for i, req_id in enumerate(inputs.req_ids))

    def _masks(self, inputs: StepInputs, constrained: bool) -> np.ndarray:
        """[requests bucket * (k + 1), words]: each request's masks after each draft."""
        grammars = self.runner.grammars
        if not constrained:
            return grammars.all_allowed(inputs.num_reqs_bucket * (1 + self.spec.num_spec))
        drafts, num_drafts, _ = self.spec.scheduled_drafts(self.runner.input_batch, inputs)
        return grammars.draft_masks(inputs.req_ids, inputs.samples, drafts, num_drafts)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        inputs, step = pending.inputs, pending.extra
        if inputs is None or not isinstance(step, SpecStep):
            return ModelRunnerOutput.empty()
        ib, grammars = self.runner.input_batch, self.runner.grammars
        emitted, proposals = self.spec.finish(ib, inputs, step)
        for i, req_id in enumerate(inputs.req_ids):
            if emitted[i] and req_id in grammars:
                grammars.advance(req_id, int(inputs.sample_positions[i]), emitted[i])
        speculating = self.spec.policy.speculate(len(inputs.req_ids))
        if step.first is not None and speculating:
            proposals = masked_proposals(self.spec, self.runner.model.model_state, ib, inputs,
                                         step, emitted, grammars)
            # Drawn for every request that was eligible at dispatch: not for one
            # whose drafts the gate stopped in `finish`.
            proposals = [[] if rid in self.spec.unsynced else p
                         for rid, p in zip(inputs.req_ids, proposals, strict=True)]
        if not speculating:
            proposals = [[] for _ in proposals]  # the next step runs plain
        for i, req_id in enumerate(inputs.req_ids):
            if proposals[i] and req_id in grammars:
                # A draft the grammar refuses would be rejected: not worth verifying.
                proposals[i] = grammars.valid_drafts(req_id, list(proposals[i]))
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(inputs.req_ids)},
            sampled_token_ids=emitted,
            spec_token_ids=proposals,
            logprobs=(None if pending.num_logprobs is None
                      else emitted_logprobs(inputs, step.verified, pending.num_logprobs)),
            prompt_logprobs=pending.prompt_logprobs,
        )

    def programs(self, plan: WarmupPlan) -> list[Program]:
        """The step in every bucket and tile (both proposer variants), then verification."""
        steps = [Program(f"speculative step tokens={t} requests={r} tile={tile}",
                         partial(self._compile_step, plan, t, r, tile))
                 for t, r, tile in with_tiles(plan.shapes, self.runner.tiled_attention)]
        verifies = [Program(f"verify requests={r} {v}",
                            partial(self._compile_verify, plan, r, v))
                    for r in plan.request_buckets for v in plan.variants]
        return steps + verifies

    def _compile_step(self, plan: WarmupPlan, tokens: int, requests: int, tile: int
                      ) -> jax.Array:
        runner, device = self.runner, self.runner.device
        state, ib = runner.model.model_state, runner.input_batch
        inputs = padding_inputs(runner, tokens, requests, tile)
        rows = requests * (1 + self.spec.num_spec)
        for variant in (SamplerVariant(), SamplerVariant(all_greedy=False)):
            tensors = dataclasses.replace(sampling_tensors(runner, inputs, variant),
                                          allowed=runner.grammars.all_allowed(rows))
            # One target pass serves every proposal below (the same programs as a
            # whole step's): on a CPU the target's forward and a sampled
            # verification over the vocabulary cost far more than the head.
            device.kv_cache, target = self.spec.target_pass(state, device.kv_cache, ib, inputs,
                                                            tensors, variant)
            # A proposal of one draft (the head's first pass alone) and one of
            # more, whose program serves every count from 2 to k; the first's
            # own program depends on the request bucket only.
            counts = ((1, self.spec.num_spec) if self.spec.policy.adapts_drafts
                      and plan.first_listing(f"one draft requests={requests} {variant}")
                      else (self.spec.num_spec,))
            for count in counts:
                step = self.spec.proposal(state, ib, inputs, target, always_draft=True,
                                          proposals=count)
                jax.block_until_ready(step.drafts)
            # The proposal of a step with constrained requests, drawn one draft at a time.
            step = self.spec.proposal(state, ib, inputs, target, always_masked=True)
            jax.block_until_ready(warm_masked_step(self.spec, state, step,
                                                   runner.grammars.all_allowed(requests)))
        # Device outputs of the same program, as verification gets them at run time.
        plan.hidden_of[tokens], plan.logits_of[requests] = target.hidden, target.logits
        return target.logits

    def _compile_verify(self, plan: WarmupPlan, requests: int, variant: SamplerVariant
                        ) -> object:
        runner, k = self.runner, self.spec.num_spec
        tensors = dataclasses.replace(runner.input_batch.sampling.tensors(
            np.zeros(0, np.int64), requests, np.zeros(0, np.int32), variant),
            allowed=runner.grammars.all_allowed(requests * (k + 1)))
        out = verify_jit(plan.logits_of[requests], tensors, np.zeros((requests, k), np.int32),
                         np.zeros(requests, np.int32), self.spec.prob_buffer,
                         np.zeros(requests, np.int32), self.spec.slots.buffer,
                         np.full(requests, -1, np.int32), variant, self.spec.draft_vocab,
                         np.int32(requests * (k + 1)), np.full(requests, -1, np.int32),
                         self.spec.follow_from[1], self.spec.max_batch)
        return out.token_ids
