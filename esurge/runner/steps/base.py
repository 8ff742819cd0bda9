"""What a step kind is: when it runs, how it is dispatched and collected, what it compiles.

The runner holds an ordered tuple of kinds, chosen once from its
configuration, and gives each step to the first kind that accepts it.
Warm-up asks the same kinds for their programs, so a step kind that exists
is a step kind that is compiled before serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import jax
import numpy as np

from esurge.models.kv_cache import KVCache
from esurge.outputs import ModelRunnerOutput, TokenLogprobs
from esurge.runner.sampler import SamplerOutput, SamplerVariant
from esurge.runner.step_inputs import StepInputs

__all__ = ["DeviceState", "PendingStep", "Program", "StepKind", "StepPlan", "WarmupPlan"]


@dataclass(slots=True)
class DeviceState:
    """The arrays a step hands to the next on the device.

    Every step donates `kv_cache` and stores the updated one back; plain
    steps store their sampled tokens in `prev_tokens` (read by the next step
    under async scheduling before they reach the host).
    """

    kv_cache: KVCache
    prev_tokens: jax.Array  # [max_rows] int32


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One scheduled step as the kinds see it: its inputs and sampling needs."""

    inputs: StepInputs
    variant: SamplerVariant
    constrained: bool  # a scheduled request follows a grammar


@dataclass(slots=True)
class PendingStep:
    """A dispatched step: its kind, host inputs and device results."""

    kind: StepKind | None
    inputs: StepInputs | None = None
    sampled: SamplerOutput | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Logprobs wanted per scheduled request, read at dispatch: by collect the
    # next step's batch update may have compacted the rows (async scheduling).
    num_logprobs: np.ndarray | None = None
    # The grammar matchers have seen this step's tokens (read early when the
    # next step's masks needed them).
    grammar_seen: bool = False
    # The sampled tokens once read to the host and written into the persistent
    # batch (at collect, or earlier for a step that cannot read them on the device).
    host_tokens: np.ndarray | None = None
    # The kind's own device results (e.g. a speculative step's drafts).
    extra: object = None
    # Drafts for the next step, handed over at dispatch: the step pipelines
    # (the next is scheduled before this one is read) and the next verifies them.
    ahead: dict[str, Sequence[int]] | None = None
    # time.perf_counter() when the runner began dispatching it.
    started: float = 0.0


@dataclass(frozen=True, slots=True)
class Program:
    """One warm-up compile: a label for the progress log and the call that compiles it.

    `run` returns device arrays to wait for.
    """

    label: str
    run: Callable[[], object]


@dataclass(slots=True)
class WarmupPlan:
    """The shapes and sampler variants to compile, and outputs shared between programs.

    A program's device outputs feed the programs after it (the sampler reads
    the model step's logits): inputs of another origin can carry other
    placement metadata and would fill different cache entries.
    """

    shapes: list[tuple[int, int]]  # (tokens, requests) buckets
    variants: list[SamplerVariant]
    logits_of: dict[int, jax.Array] = field(default_factory=dict)  # by request bucket
    hidden_of: dict[int, jax.Array] = field(default_factory=dict)  # by token bucket
    listed: set[str] = field(default_factory=set)  # program families already listed

    def first_listing(self, family: str) -> bool:
        """True the first time a family of programs shared by several kinds is listed."""
        if family in self.listed:
            return False
        self.listed.add(family)
        return True

    @property
    def request_buckets(self) -> list[int]:
        """The request buckets among the shapes, ascending."""
        return sorted({r for _, r in self.shapes})

    @property
    def token_buckets(self) -> list[int]:
        """The token buckets among the shapes, ascending."""
        return sorted({t for t, _ in self.shapes})


class StepKind(Protocol):
    """One way of running a step on the device.

    `pipelined`: the next step may be scheduled and dispatched while this one
    runs (async scheduling); a kind whose results decide the next step's
    shape (how many drafts it accepted) says False, unless a step of it hands
    its drafts ahead (PendingStep.ahead).
    """

    name: str
    pipelined: bool

    def accepts(self, plan: StepPlan) -> bool:
        """True when this kind runs the planned step."""

    def dispatch(self, plan: StepPlan) -> PendingStep:
        """Start the step on the device (async: returns before its results exist)."""

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for the step's results; record and return its sampled tokens."""

    def programs(self, plan: WarmupPlan) -> list[Program]:
        """Every program the kind can run for these shapes, to compile at warm-up."""
