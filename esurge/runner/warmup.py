"""Ahead-of-time compilation of every step shape, so no request waits for XLA.

The programs come from the runner's step kinds (each lists what it can run),
then the prompt-logprob gather every kind's steps may need.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import jax
import numpy as np

from esurge.runner.device_step import prompt_logprobs_step
from esurge.runner.prompt_logprobs import gather_rows
from esurge.runner.sampler import MAX_LOGPROBS, SamplerVariant
from esurge.runner.steps.base import Program, WarmupPlan

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["warm_up", "warmup_programs"]

log = logging.getLogger(__name__)


def _prompt_logprob_programs(runner: eSurgeRunner, plan: WarmupPlan) -> list[Program]:
    """The gather over each token bucket's final hidden states (left by the step programs)."""
    if not plan.variants:
        return []

    def compile_one(tokens: int) -> object:
        idx = np.zeros(gather_rows(tokens), np.int32)
        return prompt_logprobs_step(runner.model.model_state.shell_state(),
                                    plan.hidden_of[tokens], idx, idx, MAX_LOGPROBS)

    return [Program(f"prompt logprobs tokens={t}", partial(compile_one, t))
            for t in plan.token_buckets]


def warmup_programs(runner: eSurgeRunner, plan: WarmupPlan) -> list[Program]:
    """Every program the runner's step kinds can run for the plan's shapes, in order."""
    programs = [p for kind in runner.step_kinds for p in kind.programs(plan)]
    return programs + _prompt_logprob_programs(runner, plan)


def warm_up(runner: eSurgeRunner, progress: Callable[[int, int, str], None] | None,
            shapes: list[tuple[int, int]] | None = None,
            variants: list[SamplerVariant] | None = None) -> float:
    """Run every program once; returns the seconds it took.

    Programs are dispatched without waiting for each to finish: while one
    runs on the device, the next is traced and compiled on the host (its
    inputs are the earlier programs' outputs, so the order holds).
    """
    start = time.perf_counter()
    plan = WarmupPlan(runner.buckets.shapes() if shapes is None else shapes,
                      runner.sampler_variants() if variants is None else variants)
    programs = warmup_programs(runner, plan)
    outputs = []
    for done, program in enumerate(programs, 1):
        outputs.append(program.run())
        if progress is not None:
            progress(done, len(programs), program.label)
        log.debug("warm-up %d/%d %s", done, len(programs), program.label)
    jax.block_until_ready(outputs)
    seconds = time.perf_counter() - start
    log.info("warm-up compiled %d programs in %.1fs (%s)", len(programs), seconds,
             ", ".join(kind.name for kind in runner.step_kinds))
    return seconds
