"""Eagle speculative decoding inside the runner's step.

With speculation on, one step is: the target forward over [last token +
drafts] rows (plus any prefill rows), verification of the drafts
(`verify.verify_jit`), then the proposer drafting the next k tokens
per request from this step's target features. Everything stays on the
device until `finish` reads the emitted tokens, which waits for the
verification only: the new drafts stay in the head's draft buffer
(`draft_slots`) and go back as `DeviceDrafts`, so the engine schedules and
dispatches the next step while the device still drafts, and that step
reads them there (`StepInputs.draft_feed`, `verify`'s draft slots). A
steady step hands them over at dispatch instead (SpeculativeStep): the
next step then starts where this one's verification leaves each request,
which only the device knows (`follow_from`, StepInputs.follow_src).

Requests whose sampling needs per-token host state (penalties, logit bias,
allowed/bad tokens, min_tokens) are verified like any other but get no
drafts: their masks for positions after a draft would need the draft
tokens on the host first. So do requests that ran a plain step (`unsynced`:
the head's cache lacks that step's tokens), which the runner takes where
speculation does not pay (`policy`, esurge.spec_decode.policy), until they
compute those tokens again where it pays (`sync`, head_sync.py).

Draft distributions of sampled requests are kept on the device in a buffer
of max_rows + 1 slots (the last one a sink for padding rows), the slots of
the draft buffer, until their drafts are verified, which may be a later step
than the next when the token budget skipped the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from esurge.config import SpeculativeConfig
from esurge.models.forward import ModelState
from esurge.models.kv_cache import KVCache
from esurge.models.loader import LoadedModel
from esurge.models.tensor_parallel import kv_cache_sharding, replicated
from esurge.outputs import ModelRunnerOutput
from esurge.runner.device_step import model_step_features
from esurge.runner.host_read import to_host
from esurge.runner.input_batch import InputBatch
from esurge.runner.sampler import SamplerVariant, SamplingTensors
from esurge.runner.step_inputs import StepInputs
from esurge.runner.steps.speculative.draft_inputs import (
    allowed_count,
    draft_inputs,
    follow_inputs,
    scheduled_drafts,
)
from esurge.runner.steps.speculative.draft_slots import DraftSlots, ReadOnce
from esurge.runner.steps.speculative.head_sync import HeadSync
from esurge.runner.steps.speculative.step_results import SpecStep, TargetPass
from esurge.runner.steps.speculative.verify import store_draft_probs, verify_jit
from esurge.scheduler.output import NewRequestData, SchedulerOutput
from esurge.spec_decode.checkpoint import head_serving_dtype, head_weights, load_eagle_head
from esurge.spec_decode.config import EagleLayout
from esurge.spec_decode.draft_length import (
    Acceptance,
    DraftLength,
    StepCosts,
    head_acceptance_prior,
)
from esurge.spec_decode.policy import SpeculationPolicy, step_cost
from esurge.spec_decode.proposer import (
    DraftKVCache,
    draft_group,
    init_draft_cache,
    propose,
    propose_first,
)
from esurge.spec_decode.request_gate import RequestGate
from esurge.spec_decode.stats import SpecDecodeStats
from esurge.spec_decode.trial_bet import TrialBets

__all__ = ["SpecDecoder", "SpecStep", "TargetPass"]

log = logging.getLogger(__name__)


class SpecDecoder:
    """The Eagle head, its paged cache and the per-step verify/propose calls."""

    def __init__(self, model: LoadedModel, spec: SpeculativeConfig, groups: tuple[Any, ...],
                 num_pages: int, page_size: int, max_rows: int,
                 policy: SpeculationPolicy | None = None) -> None:
        if not spec.use_eagle() or spec.speculative_model is None:
            raise ValueError(f"speculative_config does not enable Eagle: {spec!r}")
        self.num_spec = spec.num_speculative_tokens
        self.max_batch = max_rows
        self.page_size = page_size
        # Under tensor parallelism the head is replicated: it is one small layer,
        # and its drafts must be the same on every device.
        weights = head_weights(model.config, on_mesh=model.mesh is not None)
        self.head_dtype = head_serving_dtype(model.dtype, weights)
        self.head = replicated(load_eagle_head(spec.speculative_model, model.config,
                                               self.head_dtype, weights), model.mesh)
        config = self.head.config
        self.layout = config.layout
        # The head names layer inputs; forward reports layer outputs (input of i = output of i-1).
        self.feature_layers = (tuple(i - 1 for i in config.aux_layer_ids)
                               if config.layout is EagleLayout.EAGLE3 else ())
        self.draft_vocab = config.draft_vocab_size
        self.group, self.window = draft_group(groups)
        sharding = (None if model.mesh is None
                    else kv_cache_sharding(model.mesh, config.num_kv_heads))
        self.cache: DraftKVCache = init_draft_cache(config, num_pages, page_size,
                                                    jnp.dtype(self.head_dtype), sharding)
        self.prob_buffer = replicated(jnp.zeros((max_rows + 1, self.num_spec, model.vocab_size),
                                                jnp.float32), model.mesh)
        # Each drafting request's slot for its drafts and their distributions.
        self.slots = DraftSlots(max_rows, self.num_spec, model.mesh)
        # The last verification's last tokens and rejected drafts, by row
        # ([max_rows] each): where a step dispatched before it is read starts.
        zeros = replicated(jnp.zeros(max_rows, jnp.int32), model.mesh)
        self.follow_from: tuple[jax.Array, jax.Array] = (zeros, zeros)
        self.stats = SpecDecodeStats()
        self.policy = policy or SpeculationPolicy()
        # Each step's draft count, once warm-up has measured the step costs
        # (calibrate); until then every proposal has k drafts.
        self.lengths: DraftLength | None = None
        self.prior = head_acceptance_prior(Path(spec.speculative_model), self.num_spec)
        # Requests that ran a plain step (the head never saw those tokens), or
        # whose drafts the gate stopped.
        self.unsynced: set[str] = set()
        # Where the head's cache of each that ran a plain step stops (head_sync.py).
        self.sync = HeadSync()
        self.gate = RequestGate()
        # The policy's trial acceptance, where it gates requests, and what trials
        # of new requests bet on (set by calibrate).
        self.trial: Acceptance | None = None
        self.bets: TrialBets | None = None
        self._last_collected: float | None = None
        log.info("Eagle speculative decoding: %s head from %s, k=%d, draft group %d %s",
                 config.layout.value, spec.speculative_model, self.num_spec, self.group,
                 self.window)

    def calibrate(self, costs: StepCosts | None) -> None:
        """Choose draft counts from now on by these measured step costs (a policy
        that gates requests also decides by them where requests try drafting)."""
        if costs is None or costs.k != self.num_spec:
            return
        lengths = self.lengths = DraftLength(costs, Acceptance(self.num_spec, prior=self.prior))
        if self.policy.gates_requests:
            self.trial = Acceptance(self.num_spec, prior=self.policy.trial_rate)
            self.bets = TrialBets(lengths, self.policy.trial_rate, self.prior)
            self.policy.predict_trial = self.bets.gain

    def drafts_for(self, req_ids: Sequence[str]) -> int:
        """How many drafts to propose for a step of these requests: by their own
        acceptance where the policy gates requests, else the engine-wide one
        (after a few hard chats that said one draft, where SmolLM2's easy
        chats then accepted 3 to 4 of 4)."""
        lengths = self.lengths
        if lengths is None:
            return self.num_spec
        if not self.policy.gates_requests:
            return lengths.best(len(req_ids))
        own = [self.gate.acceptance_of(r) or lengths.acceptance for r in req_ids
               if r not in self.unsynced]
        return lengths.best(len(req_ids), own, riders=len(req_ids) - len(own))

    def admit(self, new: NewRequestData) -> None:
        """A request entering the batch: one the policy keeps from drafting (a
        seeded sample, see SpeculationPolicy.drafts_seeded_samples) counts as
        unsynced from the start, so a batch of such requests runs plain steps
        rather than speculative ones without drafts."""
        params = new.sampling_params
        if (not self.policy.drafts_seeded_samples and params.seed is not None
                and params.temperature > 0):
            self.unsynced.add(new.req_id)

    def speculates(self, so: SchedulerOutput) -> bool:
        """True when this step runs speculatively: drafts to verify, or a request
        that can still draft and a policy that says drafting pays at this batch."""
        if any(so.scheduled_spec_decode_tokens.values()):
            return True
        scheduled = so.num_scheduled_tokens
        if all(req_id in self.unsynced for req_id in scheduled):
            return False
        # No drafts to verify here: a step of one token per request decodes only.
        decoding = not so.scheduled_new_reqs and all(n == 1 for n in scheduled.values())
        # Prompts go through the head only if drafting pays at the batch they fill
        # toward (the 4M model at batch 32 ran 7 prompt steps through it for nothing).
        batch = len(scheduled) if decoding else min(len(scheduled) + so.num_waiting_reqs,
                                                    self.max_batch)
        return self.policy.speculate(batch, measurable=decoding)

    def observe_step(self, inputs: StepInputs, out: ModelRunnerOutput, started: float) -> None:
        """Report a collected step in which every request decoded (no prompt chunk)
        to the policy: its mode, batch size, tokens gained and its cost (step_cost)."""
        now, last = time.perf_counter(), self._last_collected
        self._last_collected = now
        self.sync.collected += 1
        # Every plain step comes here, on the loop thread that dispatches the
        # next: a plain step's drafts are all zero, so its numpy reductions are
        # skipped (each costs microseconds, several times its idle cost while
        # the device computes on the same cores).
        speculative, drafts = inputs.num_spec > 0, inputs.num_drafts
        decoding = len(inputs.req_ids) + (int(drafts.sum()) if speculative else 0)
        if inputs.num_tokens != decoding or not inputs.samples.all():
            return
        tokens = sum(len(ids) for ids in out.sampled_token_ids)
        seconds = step_cost(started, now, last)
        self.policy.observe(speculative, len(inputs.req_ids), tokens, seconds)
        if self.lengths is not None and not speculative:
            self.lengths.observe(len(inputs.req_ids), 0, seconds)
            if self.bets is not None:
                self.bets.idle()
        elif (self.lengths is not None and len(drafts)
                and drafts.min() == drafts.max() > 0):
            self.lengths.observe(len(inputs.req_ids), int(drafts[0]), seconds)

    def resyncs(self, ib: InputBatch) -> dict[str, int]:
        """Requests to compute again from where their head's cache stops, where
        drafting pays at the batch's size (HeadSync)."""
        return self.sync.wanted(ib, self.policy.speculate) if self.sync.head_end else {}

    def release(self, req_ids: set[str]) -> None:
        """Free the slots (drafts and their distributions) of requests that left the batch."""
        self.unsynced.difference_update(req_ids)
        self.sync.forget(req_ids)
        self.gate.release(req_ids)
        self.slots.release(req_ids)

    def run(self, model_state: ModelState, kv_cache: KVCache, ib: InputBatch,
            inputs: StepInputs, tensors: SamplingTensors, variant: SamplerVariant,
            *, grammar_rows: np.ndarray | None = None) -> tuple[jax.Array, KVCache, SpecStep]:
        """Target forward, verification and proposal: (final hidden [T, H], cache, step).

        When a request that drafts follows a grammar (grammar_rows [num_reqs]
        bool), the proposal stops after the first pass: its drafts are drawn
        under masks once the emitted tokens are known (`masked_proposals`).
        """
        kv_cache, target = self.target_pass(model_state, kv_cache, ib, inputs, tensors, variant)
        return target.hidden, kv_cache, self.proposal(model_state, ib, inputs, target,
                                                      grammar_rows=grammar_rows)

    def target_pass(self, model_state: ModelState, kv_cache: KVCache, ib: InputBatch,
                    inputs: StepInputs, tensors: SamplingTensors, variant: SamplerVariant,
                    requests: int | None = None) -> tuple[KVCache, TargetPass]:
        """The target forward over [last token + drafts] and their verification,
        which picks from the rows of the first `requests` (default: the step's
        requests; calibration's timing steps have none of their own)."""
        feed = inputs.draft_feed
        if feed is None:  # warm-up and calibration: every id on the host
            feed = np.full(len(inputs.batch.input_ids), -1, np.int32)
        follow = follow_inputs(inputs, *self.follow_from)
        logits, hidden, features, kv_cache, as_run = model_step_features(
            model_state, kv_cache, inputs.batch, self.feature_layers, self.slots.buffer, feed,
            follow, self.page_size, self.group)
        drafts, num_drafts, prob_slots = self.scheduled_drafts(ib, inputs)
        draft_slots = np.full(inputs.num_reqs_bucket, -1, np.int32)
        if inputs.draft_slots is not None:
            draft_slots[:len(inputs.draft_slots)] = inputs.draft_slots
        real = len(inputs.req_ids) if requests is None else requests
        verified = verify_jit(logits, tensors, drafts, num_drafts, self.prob_buffer, prob_slots,
                              self.slots.buffer, draft_slots, variant, self.draft_vocab,
                              np.int32(real * (1 + self.num_spec)), follow.src, follow.rejected,
                              self.max_batch)
        if verified.last_tokens is not None and verified.rejected is not None:
            self.follow_from = (verified.last_tokens, verified.rejected)
        if inputs.kept_slots is not None and inputs.follow_src is None:
            # Rows computed again: the head writes at their real slots. Nothing
            # follows a step in flight here (a request moves back only with no
            # step in flight), so the slots as run are the host's.
            kept = inputs.kept_slots[self.group]
            as_run = (as_run[0], np.where(kept >= 0, kept,
                                          np.asarray(inputs.batch.slot_mapping)[self.group]))
        draft_batch, eligible = draft_inputs(ib, inputs, tensors, self.group, self.unsynced,
                                             *as_run)
        return kv_cache, TargetPass(logits, hidden, features, verified, draft_batch, eligible)

    def proposal(self, model_state: ModelState, ib: InputBatch, inputs: StepInputs,
                 target: TargetPass, *, grammar_rows: np.ndarray | None = None,
                 always_draft: bool = False, always_masked: bool = False,
                 proposals: int | None = None) -> SpecStep:
        """The head's drafts after a target pass (see `run` for grammar_rows).

        always_draft runs the whole proposer even when no request gets drafts,
        always_masked stops after the first pass (warm-up and calibration);
        proposals overrides the draft count proposed for the next step (drafts_for).
        """
        verified, draft_batch, eligible = target.verified, target.draft_batch, target.eligible
        if always_masked or (grammar_rows is not None and (eligible & grammar_rows).any()):
            first, self.cache = propose_first(
                self.head, self.cache, model_state.shell_state(), draft_batch, target.features,
                verified.token_ids, verified.num_out, verified.draft_noise, window=self.window)
            return SpecStep(verified, None, eligible, first, draft_batch)
        # Without a request to draft for (prefill chunks only), the pass that writes
        # the draft's cache for this step's tokens is all that is needed.
        drafting = always_draft or bool(eligible.any())
        count = proposals if proposals is not None else self.drafts_for(inputs.req_ids)
        new_drafts, probs, self.cache = propose(
            self.head, self.cache, model_state.shell_state(), draft_batch, target.features,
            verified.token_ids, verified.num_out, verified.draft_noise,
            num_drafts=count if drafting else 1,
            max_drafts=self.num_spec, window=self.window)
        slots = self.slots.keep(inputs.req_ids, eligible, new_drafts) if drafting else None
        if probs is not None and drafting:
            self.store_probs(ib, inputs, eligible, probs)
        return SpecStep(verified, new_drafts, eligible, count=count if drafting else 1,
                        slots=slots, generation=self.slots.generation)

    def store_probs(self, ib: InputBatch, inputs: StepInputs, eligible: np.ndarray,
                    probs: jax.Array) -> None:  # probs: [R, k, V]
        """Keep the draft distributions of sampled requests until verification."""
        slots = np.full(inputs.num_reqs_bucket, self.slots.sink, np.int32)
        sampled = eligible & (ib.sampling.temperature[inputs.rows] > 0)
        for i in np.flatnonzero(sampled).tolist():
            slots[i] = self.slots.slot(inputs.req_ids[i])
        self.prob_buffer = store_draft_probs(self.prob_buffer, slots, probs)

    def scheduled_drafts(self, ib: InputBatch, inputs: StepInputs
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(drafts [R, k], their counts [R], draft-probability slots [R]) to verify."""
        return scheduled_drafts(ib, inputs, self.num_spec, self.slots)

    def finish(self, ib: InputBatch, inputs: StepInputs, step: SpecStep
               ) -> tuple[list[list[int]], list[Sequence[int]]]:
        """Record the emitted tokens; (emitted ids, next drafts) per scheduled request.
        The drafts are DeviceDrafts: this waits for the verification, not for the
        proposer."""
        tokens = to_host(step.verified.token_ids)
        num_out = to_host(step.verified.num_out)
        # The drafts stay on the device (the proposer may still be running):
        # the next step reads them there, anyone else through _ReadOnce.
        drafts = None if step.drafts is None else ReadOnce(step.drafts)
        emitted: list[list[int]] = []
        proposals: list[Sequence[int]] = []
        verifications = drafted = accepted = 0
        outcomes: list[tuple[int, int]] = []
        for i, req_id in enumerate(inputs.req_ids):
            if not inputs.samples[i]:
                emitted.append([])
                proposals.append([])
                continue
            n, nd = int(num_out[i]), int(inputs.num_drafts[i])
            new = tokens[i, :n].tolist()
            emitted.append(new)
            row = ib.row_of.get(req_id)
            if row is not None:  # not dropped by a step dispatched since (finished, preempted)
                # After the known tokens: a step built before this one was read
                # placed its tokens as if every draft had been accepted.
                ib.record_tokens(row, int(ib.num_known[row]), new)
                ib.sampling.observe(row, new)
            if nd:
                verifications, drafted, accepted = verifications + 1, drafted + nd, accepted + n - 1
                outcomes.append((nd, n - 1))
                if row is None or not self._still_drafts(req_id, nd, n - 1,
                                                          len(inputs.req_ids)):
                    proposals.append([])  # from the next step on it decodes plainly
                    continue
            proposals.append(self._proposed(ib, row, i, step, drafts)
                             if step.propose[i] and drafts is not None and row is not None
                             else [])
        self.stats.record(verifications, drafted, accepted)
        if self.lengths is not None and outcomes:
            self.lengths.acceptance.record(outcomes)
        self._stop_a_losing_mix(ib, inputs.req_ids, proposals)
        return emitted, proposals

    def _stop_a_losing_mix(self, ib: InputBatch, req_ids: Sequence[str],
                           proposals: list[Sequence[int]]) -> None:
        """Stop every request's drafts where a speculative step no longer pays the
        batch's slowest request (each at its own acceptance from its first
        verification on: RequestGate.mix_gain, SpeculationPolicy.mix_pays). The
        batch, not each request, lost: each may draft again where drafting pays
        at its batch's size (HeadSync), its head's cache ending where this
        step's tokens do."""
        lengths, trial, batch = self.lengths, self.trial, len(req_ids)
        drafting = [r for r in req_ids if r not in self.unsynced]
        if lengths is None or trial is None or batch < 2 or not drafting:
            return
        gain = self.gate.mix_gain(req_ids, set(drafting), lengths, trial)
        if self.policy.mix_pays(batch, gain):
            return
        self._stop(drafting)
        self.sync.batch_stopped(ib, drafting, batch)
        for i in range(batch):
            proposals[i] = []

    def _stop(self, req_ids: Sequence[str]) -> None:
        """These requests draft no more: from their next step on they decode plainly."""
        self.unsynced.update(req_ids)
        self.sync.stop(req_ids)
        self.gate.release(req_ids)

    def _still_drafts(self, req_id: str, drafts: int, accepted: int, batch: int) -> bool:
        """Records a verification with the gate (where the policy gates requests);
        False once the request's drafts stop paying, which stops them for good."""
        lengths = self.lengths
        if not self.policy.gates_requests or lengths is None:
            return True
        self.gate.record(req_id, drafts, accepted, lengths)
        own = self.gate.acceptance_of(req_id)
        if self.bets is not None and own is not None:
            self.bets.record(round(own.reached[0]), drafts, accepted)
        if self.gate.pays(req_id, batch, lengths):
            return True
        self._stop((req_id,))
        return False

    def _proposed(self, ib: InputBatch, row: int, i: int, step: SpecStep,
                  drafts: ReadOnce) -> Sequence[int]:
        """Request i's proposals (as many as allowed_count lets through after its
        recorded tokens), left where they wait on the device."""
        count = allowed_count(ib, row, int(ib.num_known[row]), step.count)
        if not count or step.slots is None:
            return []
        return self.slots.on_device(int(step.slots[i]), step.generation, count, drafts, i)
