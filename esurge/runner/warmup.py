"""Ahead-of-time compilation of every step shape, so no request waits for XLA."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np

from esurge.models.batch import ForwardBatch, tile_layout
from esurge.models.kv_cache import NULL_PAGE
from esurge.runner.device_step import (
    decode_burst_step,
    model_step,
    model_step_features,
    prompt_logprobs_step,
    sample_step,
)
from esurge.runner.packed_inputs import pack_inputs
from esurge.runner.sampler import MAX_LOGPROBS, SamplerVariant
from esurge.runner.spec_sampler import verify_jit
from esurge.runner.step_inputs import StepInputs, query_tiles_for_bucket

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["warm_up"]

log = logging.getLogger(__name__)


def _padding_batch(runner: eSurgeRunner, tokens: int, requests: int,
                   num_spec: int = 0, tile: int = 1) -> ForwardBatch:
    groups = len(runner.cache_groups.groups)
    max_pages = runner.input_batch.page_tables.shape[2]
    tile_rows, row_in_tiles = (tile_layout(np.zeros(0, np.int64), tokens, requests, tile)
                               if tile > 1 else (None, None))
    return ForwardBatch(
        input_ids=np.zeros(tokens, np.int32), positions=np.zeros(tokens, np.int32),
        token_req=np.zeros(tokens, np.int32),
        slot_mapping=np.full((groups, tokens), NULL_PAGE * runner.page_size, np.int32),
        page_tables=np.full((groups, requests, max_pages), NULL_PAGE, np.int32),
        query_start_loc=np.zeros(requests + 1, np.int32),
        seq_lens=np.zeros(requests, np.int32),
        logits_indices=np.zeros(requests * (1 + num_spec), np.int32),
        query_tile=tile, tile_rows=tile_rows, row_in_tiles=row_in_tiles,
    )


def _padding_inputs(runner: eSurgeRunner, tokens: int, requests: int,
                    tile: int = 1) -> StepInputs:
    """A step of no real request in the (tokens, requests) bucket."""
    none = np.zeros(0, np.int64)
    return StepInputs(
        batch=_padding_batch(runner, tokens, requests, runner.num_spec, tile), req_ids=[],
        rows=none,
        samples=np.zeros(0, bool), sample_positions=np.zeros(0, np.int32),
        seq_lens=np.zeros(0, np.int32), prev_index=np.full(tokens, -1, np.int32), num_tokens=0,
        num_reqs_bucket=requests, num_drafts=np.zeros(0, np.int32), num_spec=runner.num_spec)


def _warm_spec(runner: eSurgeRunner, shapes: list[tuple[int, int]],
               variants: list[SamplerVariant], tick: Callable[[str], None]
               ) -> dict[int, jax.Array]:
    """Speculative steps: target forward, verification and both proposer variants.

    Returns a final-hidden array per token bucket for the prompt-logprob warm-up.
    """
    spec = runner.spec
    if spec is None:
        return {}
    sampling = runner.input_batch.sampling
    logits_of: dict[int, jax.Array] = {}
    hidden_of: dict[int, jax.Array] = {}
    state = runner.model.model_state
    for tokens, requests, tile in _with_tiles(shapes, runner.tiled_attention):
        inputs = _padding_inputs(runner, tokens, requests, tile)
        rows = requests * (1 + runner.num_spec)
        for variant in (SamplerVariant(), SamplerVariant(all_greedy=False)):
            tensors = sampling.tensors(inputs.rows, requests, inputs.sample_positions, variant)
            tensors = dataclasses.replace(tensors, allowed=runner.all_allowed(rows))
            _, runner.kv_cache, step = spec.run(state, runner.kv_cache, runner.input_batch,
                                                inputs, tensors, variant, always_draft=True)
            jax.block_until_ready(step.drafts)
        # Device outputs of the same program, as the verify step gets them at run time.
        logits, hidden_of[tokens], _, runner.kv_cache = model_step_features(
            state, runner.kv_cache, inputs.batch, spec.feature_layers)
        logits_of[requests] = logits
        tick(f"speculative step tokens={tokens} requests={requests} tile={tile}")
    k = runner.num_spec
    for requests in sorted(logits_of):
        allowed = runner.all_allowed(requests * (k + 1))
        for variant in variants:
            tensors = dataclasses.replace(sampling.tensors(
                np.zeros(0, np.int64), requests, np.zeros(0, np.int32), variant), allowed=allowed)
            out = verify_jit(logits_of[requests], tensors, np.zeros((requests, k), np.int32),
                             np.zeros(requests, np.int32), spec.prob_buffer,
                             np.zeros(requests, np.int32), variant, spec.draft_vocab)
            jax.block_until_ready(out.token_ids)
            tick(f"verify requests={requests} {variant}")
    return hidden_of


def _burst_shapes(runner: eSurgeRunner, shapes: list[tuple[int, int]]
                  ) -> list[tuple[int, int, SamplerVariant]]:
    """The (tokens, requests) buckets a decode burst lands in (one token per
    request), each with the two sampler variants a burst runs."""
    if runner.decode_steps == 1 or runner.spec is not None:
        return []
    buckets = runner.buckets
    most = min(runner.max_rows, buckets.token_buckets[-1])
    wanted = {(buckets.tokens_for(n), buckets.requests_for(n)) for n in range(1, most + 1)}
    return [(t, r, SamplerVariant(all_greedy=greedy))
            for t, r in sorted(wanted.intersection(shapes)) for greedy in (True, False)]


def _warm_bursts(runner: eSurgeRunner, bursts: list[tuple[int, int, SamplerVariant]],
                 tick: Callable[[str], None]) -> None:
    groups = len(runner.cache_groups.groups)
    for tokens, requests, variant in bursts:
        later = np.full((runner.decode_steps - 1, groups, tokens), NULL_PAGE * runner.page_size,
                        np.int32)
        flat, layout = pack_inputs(_padding_batch(runner, tokens, requests),
                                   np.full(tokens, -1, np.int32), later)
        tensors = None if variant.all_greedy else runner.input_batch.sampling.tensors(
            np.zeros(0, np.int64), requests, np.zeros(0, np.int32), variant)
        out, runner.kv_cache, _ = decode_burst_step(
            runner.model.model_state, runner.kv_cache, flat, runner._prev_tokens, tensors,
            layout, variant)
        jax.block_until_ready(out)
        tick(f"decode burst tokens={tokens} requests={requests} steps={runner.decode_steps} "
             f"greedy={variant.all_greedy}")


def _with_tiles(shapes: list[tuple[int, int]], tiled: bool) -> list[tuple[int, int, int]]:
    return [(t, r, tile) for t, r in shapes for tile in query_tiles_for_bucket(t, tiled)]


def warm_up(runner: eSurgeRunner, progress: Callable[[int, int, str], None] | None,
            shapes: list[tuple[int, int]] | None = None,
            variants: list[SamplerVariant] | None = None) -> float:
    """Run every (tokens, requests) bucket and every sampler variant once."""
    start = time.perf_counter()
    shapes = runner.buckets.shapes() if shapes is None else shapes
    variants = runner.sampler_variants() if variants is None else variants
    request_buckets = sorted({r for _, r in shapes})
    token_buckets = {t for t, _ in shapes}
    bursts = _burst_shapes(runner, shapes)
    total = (len(_with_tiles(shapes, runner.tiled_attention)) + len(request_buckets) * len(variants)
             + (len(token_buckets) if variants else 0) + len(bursts))
    done = 0
    hidden_of: dict[int, jax.Array] = {}

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)
        log.debug("warm-up %d/%d %s", done, total, what)

    if runner.spec is not None:
        # Every step is speculative: the plain model step and sampler never run.
        hidden_of = _warm_spec(runner, shapes, variants, tick)
        shapes, request_buckets = [], []
    prev_index = {t: np.full(t, -1, np.int32) for t, _ in shapes}
    # The model step's own outputs feed the sampler and prompt-logprob
    # warm-ups: inputs of another origin (numpy, device_put) can carry other
    # placement metadata and would fill different cache entries.
    logits_of: dict[int, jax.Array] = {}
    for tokens, requests, tile in _with_tiles(shapes, runner.tiled_attention):
        flat, layout = pack_inputs(_padding_batch(runner, tokens, requests, tile=tile),
                                   prev_index[tokens])
        logits, hidden, runner.kv_cache, _ = model_step(
            runner.model.model_state, runner.kv_cache, flat, runner._prev_tokens, layout)
        jax.block_until_ready(logits)
        logits_of[requests], hidden_of[tokens] = logits, hidden
        tick(f"model step tokens={tokens} requests={requests} tile={tile}")
    for requests in request_buckets:
        sampling = runner.input_batch.sampling
        rows = np.zeros(0, np.int64)
        for variant in variants:
            tensors = sampling.tensors(rows, requests, np.zeros(0, np.int32), variant)
            tensors = dataclasses.replace(tensors, allowed=runner.all_allowed(requests))
            jax.block_until_ready(sample_step(logits_of[requests], tensors, variant,
                                              runner.max_rows))
            tick(f"sampler requests={requests} {variant}")
    if variants:
        for tokens in sorted(hidden_of):
            idx = np.zeros(tokens, np.int32)
            jax.block_until_ready(prompt_logprobs_step(
                runner.model.model_state, hidden_of[tokens], idx, idx, MAX_LOGPROBS))
            tick(f"prompt logprobs tokens={tokens}")
    _warm_bursts(runner, bursts, tick)
    seconds = time.perf_counter() - start
    log.info("warm-up compiled %d programs in %.1fs", total, seconds)
    return seconds
