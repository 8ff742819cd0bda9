"""Ahead-of-time compilation of every step shape, so no request waits for XLA."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np

from esurge.models.batch import ForwardBatch
from esurge.models.kv_cache import NULL_PAGE
from esurge.runner.device_step import model_step, pad_tokens, prompt_logprobs_step
from esurge.runner.sampler import MAX_LOGPROBS, SamplerVariant, sample_jit

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["warm_up"]

log = logging.getLogger(__name__)


def _padding_batch(runner: eSurgeRunner, tokens: int, requests: int) -> ForwardBatch:
    groups = len(runner.cache_groups.groups)
    max_pages = runner.input_batch.page_tables.shape[2]
    zeros = np.zeros(tokens, np.int32)
    return ForwardBatch(
        input_ids=zeros, positions=zeros, token_req=zeros,
        slot_mapping=np.full((groups, tokens), NULL_PAGE * runner.page_size, np.int32),
        page_tables=np.full((groups, requests, max_pages), NULL_PAGE, np.int32),
        query_start_loc=np.zeros(requests + 1, np.int32),
        seq_lens=np.zeros(requests, np.int32), logits_indices=np.zeros(requests, np.int32),
    )


def warm_up(runner: eSurgeRunner, progress: Callable[[int, int, str], None] | None,
            shapes: list[tuple[int, int]] | None = None,
            variants: list[SamplerVariant] | None = None) -> float:
    """Run every (tokens, requests) bucket and every sampler variant once."""
    start = time.perf_counter()
    shapes = runner.buckets.shapes() if shapes is None else shapes
    variants = runner.sampler_variants() if variants is None else variants
    request_buckets = sorted({r for _, r in shapes})
    token_buckets = {t for t, _ in shapes}
    total = (len(shapes) + len(request_buckets) * len(variants)
             + (len(token_buckets) if variants else 0))
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, what)
        log.debug("warm-up %d/%d %s", done, total, what)

    prev_index = {t: np.full(t, -1, np.int32) for t, _ in shapes}
    # The model step's own outputs feed the sampler and prompt-logprob
    # warm-ups: inputs of another origin (numpy, device_put) can carry other
    # placement metadata and would fill different cache entries.
    logits_of: dict[int, jax.Array] = {}
    hidden_of: dict[int, jax.Array] = {}
    for tokens, requests in shapes:
        batch = _padding_batch(runner, tokens, requests)
        logits, hidden, runner.kv_cache = model_step(
            runner.model.model_state, runner.kv_cache, batch, runner._prev_tokens,
            prev_index[tokens])
        jax.block_until_ready(logits)
        logits_of[requests], hidden_of[tokens] = logits, hidden
        tick(f"model step tokens={tokens} requests={requests}")
    for requests in request_buckets:
        sampling = runner.input_batch.sampling
        rows = np.zeros(0, np.int64)
        for variant in variants:
            tensors = sampling.tensors(rows, requests, np.zeros(0, np.int32), variant)
            out = sample_jit(logits_of[requests], tensors, variant)
            jax.block_until_ready(pad_tokens(out.token_ids, runner.max_rows))
            tick(f"sampler requests={requests} {variant}")
    if variants:
        for tokens in sorted(hidden_of):
            idx = np.zeros(tokens, np.int32)
            jax.block_until_ready(prompt_logprobs_step(
                runner.model.model_state, hidden_of[tokens], idx, idx, MAX_LOGPROBS))
            tick(f"prompt logprobs tokens={tokens}")
    seconds = time.perf_counter() - start
    log.info("warm-up compiled %d programs in %.1fs", total, seconds)
    return seconds
