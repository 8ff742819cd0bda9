"""Sliding-window layers really hold fewer pages, and still give transformers' logits.

The KV cache manager gives back a sliding group's pages once they fall out of
the window (their page-table entries become the null page). Here every page
the request does not hold (freed pages and the null page included) is
overwritten with large garbage before each step: the logits only stay exact
if attention never reads outside the window.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from esurge.core.kv_cache_manager import KVCacheManager
from esurge.core.kv_cache_spec import SlidingWindowSpec
from esurge.models import KVCache, RequestChunk, build_forward_batch, init_kv_cache, jit_forward
from esurge.request import EngineRequest
from esurge.sampling_params import SamplingParams
from tests.models.checkpoints import WINDOW
from tests.models.conftest import Pair
from tests.models.paged import LOGITS, MAX_PAGES, PAGE_SIZE, REQS, TOKENS
from tests.models.test_parity import assert_close, tokens
from tests.models.test_parity import hf_logits as reference_logits

NUM_PAGES, LENGTH, STEP = 160, 60, 6


def scribble(kv: KVCache, held: set[int]) -> KVCache:
    """Fill every page not held with garbage a leaked read could not hide."""
    free = jnp.asarray([p not in held for p in range(NUM_PAGES)])[:, None, None, None]
    return KVCache(tuple(jnp.where(free, 40.0, k) for k in kv.keys),
                   tuple(jnp.where(free, -40.0, v) for v in kv.values),
                   kv.layer_slots, kv.layer_specs)


def test_sliding_groups_hold_only_the_window(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("gemma2")  # layers: sliding, full, sliding
    groups = pair.loaded.cache_groups(NUM_PAGES, PAGE_SIZE)
    sliding = [isinstance(g.spec, SlidingWindowSpec) for g in groups.groups]
    assert sorted(sliding) == [False, True, True]
    manager = KVCacheManager(groups, max_model_len=LENGTH, enable_caching=False)
    ids = tokens(30, LENGTH)
    request = EngineRequest("long", ids, SamplingParams(max_tokens=1), eos_token_id=None)
    kv = init_kv_cache(groups)
    got, peak = [], [0] * len(groups.groups)
    for start in range(0, LENGTH, STEP):
        assert manager.allocate_slots(request, STEP) is not None
        tables = manager.get_pages("long").page_ids
        held = {p for table in tables for p in table if p != 0}
        peak = [max(n, sum(p != 0 for p in t)) for n, t in zip(peak, tables, strict=True)]
        kv = scribble(kv, held)
        batch = build_forward_batch(
            [RequestChunk(ids[start:start + STEP], start, tables, num_logits=STEP)],
            page_size=PAGE_SIZE, num_groups=len(tables), num_tokens_bucket=TOKENS,
            num_reqs_bucket=REQS, max_pages_per_req=MAX_PAGES, num_logits_bucket=LOGITS,
        )
        logits, _, kv = jit_forward(pair.loaded.model_state, kv, batch)
        got.append(np.asarray(logits)[:STEP])
        request.num_computed_tokens += STEP
    assert_close(np.concatenate(got), reference_logits(pair.hf, ids))
    # A step reaches back window - 1 tokens before its first token: at most 4 pages of 4.
    window_pages = -(-(WINDOW + STEP - 2) // PAGE_SIZE) + 1
    assert [n for n, s in zip(peak, sliding, strict=True) if s] == [window_pages] * 2
    assert [n for n, s in zip(peak, sliding, strict=True) if not s] == [LENGTH // PAGE_SIZE]
