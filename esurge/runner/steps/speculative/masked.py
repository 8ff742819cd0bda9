"""Drafts that follow grammars: the proposer one position at a time, each
draw under the mask the request's matcher gives after the drafts before it.

A speculative step with a constrained request that drafts stops its
proposal after the first pass (`SpecDecoder.run`). Once the host has fed
the step's emitted tokens to the matchers, the first draft is drawn again
under the mask after them and each further draft under the mask after the
drafts so far: one device call and one read per draft position. Requests
without a grammar in the same batch draft through the same calls under
all-allowed masks, so they get the drafts the fused proposer would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from esurge.models.forward import ModelState
from esurge.runner.host_read import to_host
from esurge.runner.input_batch import InputBatch
from esurge.runner.step_inputs import StepInputs
from esurge.runner.steps.speculative.draft_inputs import allowed_count
from esurge.spec_decode.proposer import DraftBatch, FirstDraft, masked_draft_step
from esurge.structured_output.batch import GrammarBatch

if TYPE_CHECKING:
    from esurge.runner.steps.speculative.decoder import SpecDecoder, SpecStep

__all__ = ["masked_proposals", "warm_masked_step"]


class _Drawer:
    """The masked draft step's fixed arguments, moved to the device once per proposal."""

    def __init__(self, spec: SpecDecoder, model_state: ModelState, step: SpecStep,
                 batch: DraftBatch) -> None:
        # The draft step reads only the target's embedding and LM head.
        self.spec, self.shell = spec, model_state.shell_state()
        self.noise = step.verified.draft_noise
        self.page_tables, self.live, self.temperature = jax.device_put(
            (batch.page_tables, batch.propose, batch.temperature))

    def __call__(self, carry: FirstDraft, position: int, masks: np.ndarray) -> FirstDraft:
        spec = self.spec
        carry, spec.cache = masked_draft_step(
            spec.head, spec.cache, self.shell, self.page_tables, self.live,
            self.temperature, carry, None if self.noise is None else self.noise[position],
            masks, np.bool_(position > 0), window=spec.window)
        return carry


def masked_proposals(spec: SpecDecoder, model_state: ModelState, ib: InputBatch,
                     inputs: StepInputs, step: SpecStep, emitted: list[list[int]],
                     grammars: GrammarBatch) -> list[Sequence[int]]:
    """Each scheduled request's next drafts, drawn under its grammar's masks.

    Call after the step's emitted tokens were fed to the matchers. A request
    stops drafting before a draft its grammar refuses (a row the mask leaves
    no draft-vocabulary token draws unmasked, and that draft is dropped).
    """
    batch = step.draft_batch
    if step.first is None or batch is None:
        return [[] for _ in inputs.req_ids]
    n, bucket = len(inputs.req_ids), inputs.num_reqs_bucket
    prefixes: list[list[int] | None] = [[] if step.propose[i] else None for i in range(n)]
    proposals: list[list[int]] = [[] for _ in range(n)]
    draw, carry, probs = _Drawer(spec, model_state, step, batch), step.first, []
    for position in range(spec.drafts_for(inputs.req_ids)):
        masks, ok = grammars.prefix_masks(inputs.req_ids, prefixes, bucket)
        for i, prefix in enumerate(prefixes):
            if prefix is not None and not ok[i]:
                proposals[i], prefixes[i] = prefix[:-1], None
        if all(prefix is None for prefix in prefixes):
            break
        carry = draw(carry, position, masks)
        if carry.probs is not None:
            probs.append(carry.probs)
        tokens = to_host(carry.token)
        for i, prefix in enumerate(prefixes):
            if prefix is not None:
                prefix.append(int(tokens[i]))
    for i, prefix in enumerate(prefixes):
        if prefix is not None:
            proposals[i] = prefix
    if probs:
        missing = [jnp.zeros_like(probs[0])] * (spec.num_spec - len(probs))
        spec.store_probs(ib, inputs, step.propose, jnp.stack(probs + missing, axis=1))
    return [p[:_allowed(ib, req_id, len(p))] if p else []
            for req_id, p in zip(inputs.req_ids, proposals, strict=True)]


def _allowed(ib: InputBatch, req_id: str, count: int) -> int:
    """allowed_count after this step's tokens were recorded (0: left the batch)."""
    row = ib.row_of.get(req_id)
    return 0 if row is None else allowed_count(ib, row, int(ib.num_known[row]), count)


def warm_masked_step(spec: SpecDecoder, model_state: ModelState, step: SpecStep,
                     allowed: np.ndarray) -> jax.Array:
    """Compile the masked draft step for this step's request bucket (warm-up)."""
    if step.first is None or step.draft_batch is None:
        raise ValueError("warm_masked_step needs a step run with always_masked")
    draw = _Drawer(spec, model_state, step, step.draft_batch)
    return draw(step.first, 1, allowed).token
