"""An Eagle runner's step costs, measured once its programs are compiled.

Warm-up compiles with steps of padding only, which the CPU kernels skip, so
their times say nothing. Here the same compiled programs run on batches
whose token rows count as real (they read and write only the null page): a
plain step at each batch size of a grid, and a speculative step at each
batch size and draft count. `DraftLength` (esurge.spec_decode.draft_length)
weighs these against the measured acceptance to choose each step's drafts.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import jax
import numpy as np

from esurge.runner.sampler import SamplerVariant, SamplingTensors
from esurge.runner.step_inputs import StepInputs
from esurge.runner.steps.padding import padding_inputs
from esurge.runner.steps.plain import run_model_step, sampling_tensors
from esurge.runner.steps.speculative.decoder import TargetPass
from esurge.spec_decode.draft_length import CostCurve, StepCosts

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["measure_step_costs", "timing_inputs"]

log = logging.getLogger(__name__)

BATCH_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def timing_inputs(runner: eSurgeRunner, requests: int, drafts: int) -> StepInputs | None:
    """A step of no real request whose batch has `requests * (drafts + 1)` real token
    rows and as many logits rows, in the smallest buckets that hold it (None
    where none does)."""
    rows = requests * (drafts + 1)
    buckets = runner.buckets
    try:
        tokens, bucket = buckets.tokens_for(rows), buckets.requests_for(requests)
    except ValueError:
        return None
    if not drafts:  # a plain step's model pads its requests as warm-up compiled it
        bucket = buckets.model_requests(bucket)
    inputs = padding_inputs(runner, tokens, bucket)
    width = 1 + (runner.num_spec if drafts else 0)
    logits = np.zeros(bucket * width, np.int32)
    # Verification reads 1 + drafts logits rows per request at its own offset;
    # the model's LM head runs over every row up to the last real one.
    for i in range(requests):
        logits[i * width:i * width + drafts + 1] = np.arange(i * (drafts + 1),
                                                            (i + 1) * (drafts + 1))
    qsl = np.full(bucket + 1, rows, np.int32)
    qsl[0] = 0
    batch = dataclasses.replace(inputs.batch, query_start_loc=qsl, logits_indices=logits)
    return dataclasses.replace(inputs, batch=batch)


def _drafting(target: TargetPass, requests: int) -> TargetPass:
    """The target pass with its first `requests` rows drafting: the draft steps
    compute the rows up to the last that drafts, so a timing step without real
    requests would time none (its verification is told the same count)."""
    propose = np.zeros_like(np.asarray(target.draft_batch.propose))
    propose[:requests] = True
    return dataclasses.replace(
        target, draft_batch=dataclasses.replace(target.draft_batch, propose=propose))


def _seconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed runs (after one untimed)."""
    jax.block_until_ready(run())
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(run())
        best = min(best, time.perf_counter() - began)
    return best


def _rising(points: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """The points with each time raised to the largest before it: a step of more
    rows never costs less, so a lower time is the noise of a short measurement."""
    out, top = [], 0.0
    for size, seconds in points:
        top = max(top, seconds)
        out.append((size, top))
    return tuple(out)


def _rising_with_drafts(curves: list[list[tuple[int, float]]]) -> tuple[CostCurve, ...]:
    """Each draft count's curve rising with the batch and never below the curve
    of one draft fewer at the same batch size."""
    out: list[CostCurve] = []
    below: dict[int, float] = {}
    for points in curves:
        raised = _rising([(b, max(t, below.get(b, 0.0))) for b, t in points])
        below = dict(raised)
        out.append(CostCurve(raised))
    return tuple(out)


def measure_step_costs(runner: eSurgeRunner, repeats: int = 3) -> StepCosts | None:
    """Plain and speculative decode steps timed over BATCH_GRID (up to the
    runner's request limit); None where not even one request fits a bucket."""
    spec = runner.spec
    if spec is None:
        return None
    began = time.perf_counter()
    limit = runner.config.scheduler_config.max_num_seqs
    variant = SamplerVariant()
    plain: list[tuple[int, float]] = []
    speculative: list[list[tuple[int, float]]] = [[] for _ in range(spec.num_spec)]
    state, ib, device = runner.model.model_state, runner.input_batch, runner.device
    for batch in (b for b in BATCH_GRID if b <= limit):
        inputs = timing_inputs(runner, batch, 0)
        if inputs is not None:
            plain.append((batch, _seconds(partial(run_model_step, runner, inputs), repeats)))
        for drafts in range(1, spec.num_spec + 1):
            step_inputs = timing_inputs(runner, batch, drafts)
            if step_inputs is None:
                continue
            tensors = sampling_tensors(runner, step_inputs, variant)
            tensors = dataclasses.replace(tensors, allowed=runner.grammars.all_allowed(
                step_inputs.num_reqs_bucket * (1 + spec.num_spec)))

            def run(step_inputs: StepInputs = step_inputs, tensors: SamplingTensors = tensors,
                    drafts: int = drafts, batch: int = batch) -> object:
                device.kv_cache, target = spec.target_pass(state, device.kv_cache, ib,
                                                           step_inputs, tensors, variant,
                                                           requests=batch)
                step = spec.proposal(state, ib, step_inputs, _drafting(target, batch),
                                     always_draft=True, proposals=drafts)
                return step.verified.token_ids, step.drafts

            speculative[drafts - 1].append((batch, _seconds(run, repeats)))
    if not plain or not all(speculative):
        return None
    costs = StepCosts(CostCurve(_rising(plain)), _rising_with_drafts(speculative))
    log.info("step costs measured in %.1fs: plain@1 %.2f ms, speculative@1 by drafts %s ms",
             time.perf_counter() - began, costs.plain(1) * 1e3,
             " ".join(f"{costs.speculative(1, d) * 1e3:.2f}" for d in range(1, spec.num_spec + 1)))
    return costs
