"""The verification rules on their own: greedy prefix acceptance and rejection
sampling whose emitted tokens follow the target distribution exactly."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from esurge.spec_decode.rejection import accept_greedy, rejection_sample

# Chi-square critical value for 7 degrees of freedom at p = 0.001.
CHI2_CRIT_DF7 = 24.32


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accepts_longest_agreeing_prefix() -> None:
    target = jnp.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = jnp.array([[5, 6, 7], [5, 9, 7], [4, 6, 7], [1, 2, 3]])
    num_drafts = jnp.array([3, 3, 3, 2])
    tokens, num_out = accept_greedy(target, drafts, num_drafts)
    assert num_out.tolist() == [4, 2, 1, 3]  # all + bonus, one + correction, none, capped at 2
    assert np.asarray(tokens)[1, :2].tolist() == [5, 6]  # the target's token replaces draft 9
    assert np.asarray(tokens)[3, :3].tolist() == [1, 2, 3]


def _random_dists(rng: np.random.Generator, rows: int, vocab: int, sharp: float) -> np.ndarray:
    logits = rng.standard_normal((rows, vocab)) * sharp
    return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


def test_rejection_sampling_emits_the_target_distribution() -> None:
    rng = np.random.default_rng(0)
    vocab, k, n = 8, 3, 40_000
    p = _random_dists(rng, k + 1, vocab, 1.5)  # the target's distribution per row
    q = _random_dists(rng, k, vocab, 1.5)  # the draft's, deliberately different
    drafts = np.stack([rng.choice(vocab, size=n, p=q[j]) for j in range(k)], axis=1)
    target_samples = np.stack([rng.choice(vocab, size=n, p=p[j]) for j in range(k + 1)], axis=1)
    uniforms = rng.uniform(size=(n, k))
    gumbel = -np.log(-np.log(rng.uniform(size=(n, k, vocab))))
    tokens, num_out = rejection_sample(
        jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, k + 1, vocab)),
        jnp.broadcast_to(jnp.asarray(q, jnp.float32), (n, k, vocab)),
        jnp.asarray(drafts, jnp.int32), jnp.full(n, k, jnp.int32),
        jnp.asarray(uniforms, jnp.float32), jnp.asarray(gumbel, jnp.float32),
        jnp.asarray(target_samples, jnp.int32))
    emitted, counts = np.asarray(tokens), np.asarray(num_out)
    first = np.bincount(emitted[:, 0], minlength=vocab)
    assert chi_square(first, p[0]) < CHI2_CRIT_DF7
    # The draft's own distribution is far from the target's: accepting every
    # draft would fail the same test by a wide margin.
    assert chi_square(np.bincount(drafts[:, 0], minlength=vocab), p[0]) > 10 * CHI2_CRIT_DF7
    second = np.bincount(emitted[counts >= 2, 1], minlength=vocab)
    assert chi_square(second, p[1]) < CHI2_CRIT_DF7
    # Some drafts are accepted, some rejected, some requests accept all k.
    assert 0 < (counts == 1).mean() < 1 and (counts == k + 1).any()
    # Accepted drafts are emitted unchanged.
    for j in range(k):
        keep = counts > j + 1
        assert (emitted[keep, j] == drafts[keep, j]).all()


def test_rejection_respects_fewer_drafts_and_identical_distributions() -> None:
    p = jnp.asarray([[[0.5, 0.5, 0.0]] * 3], jnp.float32)  # [1, 3, 3]
    q = p[:, :2]
    tokens, num_out = rejection_sample(
        p, q, jnp.asarray([[1, 0]]), jnp.asarray([1]), jnp.asarray([[0.99, 0.0]]),
        jnp.zeros((1, 2, 3)), jnp.asarray([[2, 2, 2]]))
    # p == q: the draft is always accepted; with one draft the next token is the
    # target's own sample at row 1.
    assert int(num_out[0]) == 2
    assert np.asarray(tokens)[0, :2].tolist() == [1, 2]
