"""The step function's contract: compile once per bucket, hidden outputs, padding isolation."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
import pytest
import torch

from esurge.models import RequestChunk, build_forward_batch, forward, init_kv_cache, jit_forward
from tests.models.conftest import Pair
from tests.models.paged import LOGITS, MAX_PAGES, PAGE_SIZE, REQS, TOKENS, PagedSession, Row
from tests.models.test_parity import tokens


def compilations() -> int:
    """Programs jit_forward has compiled so far (all models and shapes)."""
    return int(jit_forward._cache_size())  # type: ignore[attr-defined]


def test_steps_of_one_bucket_never_recompile(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("qwen3")
    a, b, c = tokens(40, 30), tokens(41, 30), tokens(42, 30)
    session = PagedSession(pair.loaded, seed=5)
    session.step([Row("a", a[:10], 0)])  # compiles this bucket if no test did before
    compiled = compilations()
    session.step([Row("a", a[10:12], 10, 2), Row("b", b[:20], 0)])
    for pos in range(20, 26):
        session.step([Row("a", [a[pos - 8]], pos - 8), Row("b", [b[pos]], pos),
                      Row("c", c[pos - 20:pos - 18], pos - 20, 2)])
    session.step([Row("c", c[6:30], 6, 24)])
    assert compilations() == compiled
    # A different token bucket is a different program: exactly one more compilation.
    small = build_forward_batch(
        [RequestChunk([a[0]], 0, session.tables["a"])], page_size=PAGE_SIZE,
        num_groups=session.num_groups, num_tokens_bucket=8, num_reqs_bucket=REQS,
        max_pages_per_req=MAX_PAGES, num_logits_bucket=LOGITS,
    )
    _, _, session.kv = jit_forward(pair.loaded.model_state, session.kv, small)
    assert compilations() == compiled + 1


def test_hidden_states_and_aux_layers_match_transformers(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("llama")
    ids = tokens(43, 12)
    batch = build_forward_batch(
        [RequestChunk(ids, 0, [list(range(1, 5))], num_logits=3)], page_size=PAGE_SIZE,
        num_groups=1, num_tokens_bucket=16, num_reqs_bucket=2, max_pages_per_req=8,
        num_logits_bucket=3,
    )
    groups = pair.loaded.cache_groups(8, PAGE_SIZE)
    state = pair.loaded.model_state
    logits, hidden, _ = jit_forward(state, init_kv_cache(groups), batch)
    logits_aux, aux, _ = jit_forward(state, init_kv_cache(groups), batch,
                                     aux_hidden_layer_ids=(1, 0))
    with torch.no_grad():
        out = pair.hf(torch.tensor([ids]), output_hidden_states=True)
        # transformers' last hidden state is after the final norm; layer 1's raw output is not
        # kept, so check that the final norm of ours gives it.
        final_from_aux = pair.hf.model.norm(torch.tensor(np.asarray(aux[0, :12]))).numpy()
    want_final = out.hidden_states[-1][0].numpy()
    assert hidden.shape == (16, 64) and aux.shape == (2, 16, 64)
    np.testing.assert_allclose(np.asarray(hidden)[:12], want_final, atol=1e-5)
    np.testing.assert_allclose(final_from_aux, want_final, atol=1e-5)
    np.testing.assert_allclose(np.asarray(aux[1, :12]), out.hidden_states[1][0].numpy(),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits), out.logits[0, 9:12].numpy(), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(logits_aux), np.asarray(logits))


@pytest.mark.parametrize("ids", [(2,), (0, 0), (-1,)])
def test_bad_aux_layer_ids_are_refused(make_pair: Callable[..., Pair], ids: tuple[int, ...]
                                       ) -> None:
    pair = make_pair("llama")
    session = PagedSession(pair.loaded)
    batch = build_forward_batch(
        [RequestChunk([1, 2], 0, [[1]])], page_size=PAGE_SIZE, num_groups=1,
        num_tokens_bucket=TOKENS, num_reqs_bucket=REQS, max_pages_per_req=MAX_PAGES,
    )
    with pytest.raises(ValueError, match="aux_hidden_layer_ids"):
        jit_forward(pair.loaded.model_state, session.kv, batch, aux_hidden_layer_ids=ids)


def test_padding_writes_only_the_null_page(make_pair: Callable[..., Pair]) -> None:
    """Padded rows of a step land in page 0; no other page changes but the request's own."""
    pair = make_pair("mistral")
    session = PagedSession(pair.loaded, seed=6)
    before = [np.asarray(k) for k in session.kv.keys]
    session.step([Row("a", tokens(44, 5), 0)])  # 5 real rows, 19 padding rows
    (table,) = session.tables["a"]
    written = [int(table[0]), int(table[1])]
    for old, new in zip(before, session.kv.keys, strict=True):
        changed = {int(p) for p in np.nonzero(np.any(np.asarray(new) != old, axis=(1, 2, 3)))[0]}
        # Page 0 changes unless the padding rows' keys are zeros, as the CPU
        # matmul kernel leaves them (it skips padding rows).
        assert set(written) <= changed <= {0, *written}
        assert np.all(np.isfinite(np.asarray(new)))


def test_equal_graphs_share_one_definition_after_the_first_comparison(
        make_pair: Callable[..., Pair]) -> None:
    # jit compares the static graph of every call with its cache entries; a
    # second load of the same model must not pay a deep comparison each step.
    from esurge.models import load_model

    path = make_pair("llama").path
    first, second = (load_model(path).model_state for _ in range(2))
    assert first.graphdef is not second.graphdef
    assert first._shape == second._shape
    assert first.graphdef is second.graphdef
    other = load_model(path, "bfloat16").model_state
    assert first._shape != other._shape  # other dtype: another graph


@pytest.mark.parametrize(("family", "structures"), [("llama", 1), ("gemma3", 2)])
def test_layers_of_one_structure_share_one_trace(make_pair: Callable[..., Pair], family: str,
                                                 structures: int) -> None:
    """Every layer is a nested call, and layers alike (Gemma 3: sliding or full) share its jaxpr."""
    pair = make_pair(family)
    state = pair.loaded.model_state
    num_groups = 2 if family == "gemma3" else 1  # sliding and full layers: a group each
    batch = build_forward_batch(
        [RequestChunk(tokens(44, 5), 0, [list(range(1, 5))] * num_groups)],
        page_size=PAGE_SIZE, num_groups=num_groups, num_tokens_bucket=8, num_reqs_bucket=2,
        max_pages_per_req=8, num_logits_bucket=1,
    )
    groups = pair.loaded.cache_groups(8, PAGE_SIZE)
    jaxpr = jax.make_jaxpr(forward)(state, init_kv_cache(groups), batch)
    calls = [e.params["jaxpr"] for e in jaxpr.jaxpr.eqns
             if e.params.get("name") == "_shared_layer"]
    assert len(calls) == state.module().config.num_layers
    assert len({id(call) for call in calls}) == structures


def test_model_state_flattens_to_its_params_leaves_and_shell(make_pair: Callable[..., Pair]
                                                              ) -> None:
    state = make_pair("llama").loaded.model_state
    params_leaves = jax.tree_util.tree_leaves(state.params)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert len(leaves) == len(params_leaves)
    assert all(a is b for a, b in zip(leaves, params_leaves, strict=True))
    # A mapped state is rebuilt with params in the same places.
    doubled = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) * 2 for x in leaves])
    np.testing.assert_array_equal(doubled.params["model"]["norm"]["weight"],
                                  np.asarray(state.params["model"]["norm"]["weight"]) * 2)
    assert str(jax.tree_util.tree_structure(doubled)) == str(treedef)
    # The shell holds every parameter but the decoder layers', and is kept.
    shell = state.shell_state()
    assert shell is state.shell_state()
    no_layers = {**state.params, "model": {k: v for k, v in state.params["model"].items()
                                            if k != "layers"}}
    assert [id(x) for x in jax.tree_util.tree_leaves(shell)] == [
        id(x) for x in jax.tree_util.tree_leaves(no_layers)]
    assert len(jax.tree_util.tree_leaves(shell)) < len(leaves)
    hidden = jax.numpy.ones((2, state.shell().config.hidden_size), jax.numpy.float32)
    logits = jax.jit(lambda s, h: s.shell().compute_logits(h))(shell, hidden)
    np.testing.assert_allclose(logits, state.shell().compute_logits(hidden), rtol=1e-6)
