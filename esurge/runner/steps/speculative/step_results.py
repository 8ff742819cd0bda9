"""What a speculative step leaves on the device between its dispatch and its
collection: the target pass before the proposal, and the whole step."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from esurge.runner.steps.speculative.verify import SpecSamplerOutput
from esurge.spec_decode.proposer import DraftBatch, FirstDraft

__all__ = ["SpecStep", "TargetPass"]


@dataclass(slots=True)
class SpecStep:
    """A dispatched speculative step: device results plus host facts to read them.

    A step whose drafts must follow grammars has no `drafts` yet: `first` and
    `draft_batch` are where `masked_proposals` continues once the host knows
    the emitted tokens.
    """

    verified: SpecSamplerOutput
    drafts: jax.Array | None  # [R, D] int32: the first `count` of each row proposed
    propose: np.ndarray  # [num_reqs] bool
    first: FirstDraft | None = None
    draft_batch: DraftBatch | None = None
    count: int = 0  # drafts proposed per request
    # [R] each request's slot in the draft buffer (the sink where it did not
    # draft), and which proposal of the decoder this was (None: not kept there).
    slots: np.ndarray | None = None
    generation: int = 0


@dataclass(slots=True)
class TargetPass:
    """A speculative step's target forward and verification, before its proposal."""

    logits: jax.Array  # [L, V]: each request's 1 + k rows
    hidden: jax.Array  # [T, H]
    features: jax.Array  # [T, F]: final hidden (EAGLE-1) or n layers' outputs, [T, n * H]
    verified: SpecSamplerOutput
    draft_batch: DraftBatch
    eligible: np.ndarray  # [num_reqs] bool: requests that may draft
