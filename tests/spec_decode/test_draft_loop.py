"""The compiled draft loop of a bfloat16 head beside a bfloat16 target."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from esurge.models import load_model
from esurge.models.cpu_kernels import kernels_serve
from esurge.spec_decode.checkpoint import head_weights, load_eagle_head
from esurge.spec_decode.proposer import (
    AttentionWindow,
    FirstDraft,
    _propose_rest,
    init_draft_cache,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    not kernels_serve(jnp.bfloat16),
    reason="no native bfloat16 kernels: XLA's bfloat16 matmuls convert the head's weights "
           "to float32 in scratch, which hides what this measures")
def test_the_draft_loop_never_copies_the_targets_embedding_table() -> None:
    # Each draft step embeds its token with the target's table. A float32 copy
    # of that whole table, hoisted out of the loop, made bfloat16 proposals 20x
    # slower: the program's scratch memory shows it.
    target = load_model(REPO / "models" / "tiny-stdlib", "bfloat16")
    head = load_eagle_head(REPO / "models" / "tiny-stdlib-eagle", target.config, "bfloat16",
                           head_weights(target.config, on_mesh=False))
    shell = target.model_state.shell_state()
    table = shell.params["model"]["embed_tokens"]["weight"]
    assert table.dtype == jnp.bfloat16
    requests, pages = 4, 8
    cache = init_draft_cache(head.config, pages * requests, 16, jnp.bfloat16)
    first = FirstDraft(jnp.zeros(requests, jnp.int32), None,
                       jnp.zeros((requests, head.config.hidden_size), jnp.bfloat16),
                       jnp.ones(requests, jnp.int32))
    page_tables = jnp.asarray(np.arange(requests * pages, dtype=np.int32).reshape(requests, -1))
    compiled = _propose_rest.lower(
        head, cache, shell, page_tables, jnp.ones(requests, bool), jnp.zeros(requests),
        first, None, np.int32(3), max_steps=3, window=AttentionWindow()).compile()
    scratch = compiled.memory_analysis().temp_size_in_bytes
    assert scratch < table.nbytes, (scratch, table.nbytes)
