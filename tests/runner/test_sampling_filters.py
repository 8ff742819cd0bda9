"""The candidate-based top-k / top-p cut keeps exactly what a full sort keeps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esurge.runner.sampler import SamplingTensors
from esurge.runner.sampling_filters import CANDIDATES, apply_filters, sorted_cut

VOCAB = 8192
FIRST, WIDER = CANDIDATES


def _tensors(top_k: list[int], top_p: list[float], min_p: float = 0.0) -> SamplingTensors:
    rows = len(top_k)
    return SamplingTensors(
        temperature=jnp.ones(rows, jnp.float32), top_k=jnp.asarray(top_k, jnp.int32),
        top_p=jnp.asarray(top_p, jnp.float32), min_p=jnp.full(rows, min_p, jnp.float32),
        seeds=jnp.zeros((rows, 2), jnp.uint32), positions=jnp.zeros(rows, jnp.int32))


def _reference(logits: jax.Array, t: SamplingTensors) -> np.ndarray:
    """min-p, then the full sort on every row that asks for a cut."""
    probs = jax.nn.softmax(logits, axis=-1)
    logits = jnp.where(probs < t.min_p[:, None] * probs.max(-1, keepdims=True), -jnp.inf,
                       logits)
    cut = (t.top_k < logits.shape[-1]) | (t.top_p < 1.0)
    return np.asarray(jnp.where(cut[:, None], sorted_cut(logits, t), logits))


# Rows of every kind: peaked (nucleus among the first candidates), wider
# (settled by the second tier), flat (a nucleus wider than every tier: the
# sort decides), top-k inside and beyond the first candidates, both cuts, and
# rows that ask for no cut at all.
ROWS = [  # (scale of the logits, top_k, top_p)
    (4.0, VOCAB, 0.9), (4.0, 20, 1.0), (4.0, 50, 0.8), (0.05, VOCAB, 0.99),
    (0.05, FIRST + 300, 1.0), (0.05, FIRST + 300, 0.5), (4.0, VOCAB, 1.0),
    (0.05, VOCAB, 1.0), (2.0, 1, 0.9), (2.0, FIRST, 0.999), (1.0, VOCAB, 0.5),
    (0.05, WIDER + 100, 1.0),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_row_keeps_what_the_full_sort_keeps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(np.stack([rng.standard_normal(VOCAB) * s for s, _, _ in ROWS]),
                         jnp.float32)
    t = _tensors([k for _, k, _ in ROWS], [p for _, _, p in ROWS])
    got = np.asarray(jax.jit(apply_filters)(logits, t))
    want = _reference(logits, t)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
    kept = np.isfinite(got).sum(axis=1)
    assert kept[1] == 20 and kept[8] == 1 and kept[6] == kept[7] == VOCAB
    assert kept[4] == FIRST + 300 and kept[11] == WIDER + 100
    assert FIRST < kept[10] <= WIDER  # the second tier's
    assert kept[3] > WIDER  # a flat row's nucleus: the sort's own answer


@pytest.mark.parametrize("neighbour", [(4.0, VOCAB, 1.0), (0.05, VOCAB, 0.99)])
def test_a_rows_cut_does_not_depend_on_its_neighbours(neighbour: tuple[float, int, float]
                                                      ) -> None:
    """A peaked top-p row beside a row that needs no cut, or one that needs the
    full sort, keeps the same tokens."""
    rng = np.random.default_rng(7)
    row = rng.standard_normal(VOCAB) * 4.0
    alone = apply_filters(jnp.asarray(row[None], jnp.float32), _tensors([VOCAB], [0.9]))
    scale, top_k, top_p = neighbour
    pair = jnp.asarray(np.stack([row, rng.standard_normal(VOCAB) * scale]), jnp.float32)
    both = apply_filters(pair, _tensors([VOCAB, top_k], [0.9, top_p]))
    np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(alone[0]))


def test_min_p_alone_skips_the_top_k_top_p_cut() -> None:
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((2, VOCAB)) * 3, jnp.float32)
    t = _tensors([VOCAB, VOCAB], [1.0, 1.0], min_p=0.2)
    got = np.asarray(apply_filters(logits, t))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    np.testing.assert_array_equal(np.isfinite(got), probs >= 0.2 * probs.max(-1, keepdims=True))


def _primitives(jaxpr: jax.extend.core.Jaxpr, name: str) -> int:
    """Equations of primitive `name` in a jaxpr and every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    count += _primitives(inner, name)
    return count


@pytest.mark.parametrize(("vocab", "top_ks"), [(VOCAB, 2), (WIDER, 1), (FIRST, 0)])
def test_a_tier_as_wide_as_the_vocabulary_is_the_sort(vocab: int, top_ks: int) -> None:
    """Candidate tiers narrower than the vocabulary, then the sort, which cuts as
    the candidates would at full width."""
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.standard_normal((3, vocab)) * 0.05, jnp.float32)
    t = _tensors([vocab, vocab, 40], [0.999, 0.5, 1.0])
    jaxpr = jax.make_jaxpr(apply_filters)(logits, t).jaxpr
    assert _primitives(jaxpr, "top_k") == top_ks
    assert _primitives(jaxpr, "sort") == 1
    got = np.asarray(jax.jit(apply_filters)(logits, t))
    want = _reference(logits, t)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
