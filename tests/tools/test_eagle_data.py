"""The Eagle trainer's kept data: the target's labels per position as it predicted them,
padding marked, bfloat16 features read back bit for bit, every sequence once per epoch."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tools.eagle_data import FeatureSet, pad_sequences

V, F, L = 40, 6, 8


def _target(rows: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A stand-in target whose most likely next token after t is (t + 1) % V."""
    tokens = jnp.asarray(rows)
    logits = 5.0 * jax.nn.one_hot((tokens + 1) % V, V) + 0.01 * jax.nn.one_hot(tokens, V)
    features = jnp.broadcast_to(tokens[..., None].astype(jnp.float32) / 3, (*rows.shape, F))
    return features, jnp.zeros((*rows.shape, 4)), logits


def _sets() -> tuple[list[np.ndarray], np.ndarray]:
    sequences = [np.arange(3, 3 + n) for n in (5, 8, 11)]  # the last one is cut to L
    d2t = np.full(30, 2, np.int64)  # draft token d is target token d + 2
    return sequences, d2t


def test_pad_sequences_cuts_and_pads() -> None:
    tokens, lengths = pad_sequences([np.array([7, 8]), np.arange(20)], 4)
    assert tokens.tolist() == [[7, 8, 0, 0], [0, 1, 2, 3]]
    assert lengths.tolist() == [2, 4]


def test_labels_are_the_targets_next_token_in_draft_indices() -> None:
    sequences, d2t = _sets()
    data = FeatureSet.compute(_target, sequences, L, d2t, batch=2)
    assert data.tokens.shape == (3, L) and data.lengths.tolist() == [5, 8, 8]
    real = np.arange(L)[None, :] < data.lengths[:, None]
    top = (np.arange(len(d2t)) + d2t)[data.label_ids[..., 0]]
    np.testing.assert_array_equal(top[real], ((data.tokens + 1) % V)[real])
    np.testing.assert_allclose(data.label_probs.sum(-1), 1.0, rtol=1e-5)
    assert (data.label_probs[..., 0][real] > 0.9).all()
    np.testing.assert_array_equal(data.features[..., 0].astype(np.float32),
                                  (data.tokens / 3).astype(jnp.bfloat16).astype(np.float32))


def test_saved_set_reads_back_exactly(tmp_path: Path) -> None:
    sequences, d2t = _sets()
    data = FeatureSet.compute(_target, sequences, L, d2t, batch=3)
    data.save(tmp_path / "set.npz")
    back = FeatureSet.load(tmp_path / "set.npz")
    for name in ("tokens", "lengths", "label_ids", "label_probs", "d2t"):
        np.testing.assert_array_equal(getattr(back, name), getattr(data, name))
    assert back.features.dtype == data.features.dtype
    np.testing.assert_array_equal(back.features.view(np.uint16), data.features.view(np.uint16))


def test_batches_give_each_sequence_once_per_epoch_with_padding_marked() -> None:
    sequences, d2t = _sets()
    data = FeatureSet.compute(_target, sequences, L, d2t, batch=2)
    batches = data.batches(1, np.random.default_rng(0))
    seen = []
    for _ in range(3):
        _, tokens, labels = next(batches)
        length = int(np.asarray(labels.valid).sum())
        seen.append(length)
        assert np.asarray(labels.valid)[0, :length].all()
        np.testing.assert_array_equal(tokens[0, length:], 0)
    assert sorted(seen) == [5, 8, 8]
    with pytest.raises(ValueError, match="exceeds"):
        next(data.batches(4, np.random.default_rng(0)))


def test_a_set_extends_only_one_of_its_kind() -> None:
    sequences, d2t = _sets()
    first = FeatureSet.compute(_target, sequences[:2], L, d2t, batch=2)
    second = FeatureSet.compute(_target, sequences[2:], L, d2t, batch=2)
    whole = FeatureSet.compute(_target, sequences, L, d2t, batch=2)
    joined = first.extended(second)
    for name in ("tokens", "lengths", "label_ids", "label_probs", "d2t"):
        np.testing.assert_array_equal(getattr(joined, name), getattr(whole, name))
    other = FeatureSet.compute(_target, sequences[2:], L, d2t + 1, batch=2)
    with pytest.raises(ValueError, match="draft vocabulary"):
        first.extended(other)
