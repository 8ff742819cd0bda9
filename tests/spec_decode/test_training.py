"""The trainer's unrolled drafting sees exactly what drafting at inference sees: its
step-s output at position p equals running the head sequentially (a pass over the
target features up to the anchor p - s + 1, then one position per step), and a few
optimizer steps lower the loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from esurge.models.decoder_config import (
    Activation,
    AttentionKind,
    DecoderConfig,
    LayerAttention,
    RopeConfig,
    RopeType,
)
from esurge.models.rope import rope_cos_sin
from esurge.spec_decode.checkpoint import eagle_config_dict
from esurge.spec_decode.config import EagleConfig, EagleLayout
from esurge.spec_decode.head import EagleHead, init_head
from tools.eagle_training import LossWeights, head_loss, sparse_labels, unrolled_steps

H, V, N = 32, 50, 12
TARGET = DecoderConfig(
    vocab_size=V, hidden_size=H, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
    rms_norm_eps=1e-5, activation=Activation.SILU,
    layers=tuple(LayerAttention(AttentionKind.FULL, None, RopeConfig(RopeType.DEFAULT, 1e4))
                 for _ in range(4)))


class _Target:
    """Stands in for the target module: an embedding table and an LM head."""

    def __init__(self, key: jax.Array) -> None:
        self.table = jax.random.normal(key, (V, H))
        self.model = self

    def embed_tokens(self, ids: jax.Array) -> jax.Array:
        return self.table[ids]

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return hidden @ self.table.T


class _SequentialAttend:
    """Causal attention over every key written so far (inference's view of one round)."""

    def __init__(self) -> None:
        self.keys: dict[int, list[tuple[jax.Array, jax.Array, jax.Array]]] = {}
        self.positions = jnp.zeros(0, jnp.int32)

    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        store = self.keys.setdefault(layer, [])
        store.append((k, v, self.positions))
        ks = jnp.concatenate([x[0] for x in store])
        vs = jnp.concatenate([x[1] for x in store])
        kpos = jnp.concatenate([x[2] for x in store])
        group = q.shape[1] // k.shape[1]
        ks, vs = jnp.repeat(ks, group, axis=1), jnp.repeat(vs, group, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, ks) * q.shape[-1] ** -0.5
        mask = kpos[None, None, :] <= self.positions[None, :, None]
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
        return jnp.einsum("hqk,khd->qhd", probs, vs)


def _sequential(head: EagleHead, target: _Target, features: jax.Array, tokens: jax.Array,
                anchor: int, steps: int) -> list[jax.Array]:
    """Outputs of draft steps 1..steps of the round whose last target feature is `anchor`."""
    config = head.config
    attend = _SequentialAttend()

    def run(hidden: jax.Array, ids: jax.Array, positions: jax.Array) -> jax.Array:
        attend.positions = positions
        rope = rope_cos_sin(config.rope, config.head_dim, positions, positions + 1)
        return head.step(hidden, head.embed(ids, target), rope, attend)

    pos = jnp.arange(anchor + 1)
    out = run(head.first_hidden(features[:anchor + 1]), tokens[1:anchor + 2], pos)
    outs, hidden = [out[anchor]], out[anchor:anchor + 1]
    for s in range(2, steps + 1):
        p = anchor + s - 1
        hidden = run(hidden, tokens[p + 1:p + 2], jnp.array([p]))
        outs.append(hidden[0])
    return outs


@pytest.mark.parametrize("layout", list(EagleLayout))
def test_unrolled_training_matches_sequential_drafting(layout: EagleLayout) -> None:
    raw = eagle_config_dict(TARGET, layout, aux_layer_ids=(2, 3, 4), draft_vocab_size=30)
    config = EagleConfig.from_hf_dict(raw, layout, TARGET.num_layers)
    state = init_head(config, seed=0, scale=0.3)
    head, target = state.module(), _Target(jax.random.key(1))
    features = jax.random.normal(jax.random.key(2), (N, config.feature_size))
    tokens = jax.random.randint(jax.random.key(3), (N,), 0, V)
    steps = 3
    unrolled = jax.jit(lambda f, t: unrolled_steps(head, target, f, t, steps))(
        features[None], tokens[None])
    sequential = jax.jit(lambda f, t, anchor: _sequential(head, target, f, t, anchor, steps),
                         static_argnums=2)
    for anchor in (0, 7):
        for s, expected in enumerate(sequential(features, tokens, anchor), start=1):
            got = unrolled[s - 1][0, anchor + s - 1]
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-4,
                                       atol=2e-5)


def test_training_steps_lower_the_loss() -> None:
    raw = eagle_config_dict(TARGET, EagleLayout.EAGLE3, aux_layer_ids=(2, 3, 4),
                            draft_vocab_size=30)
    config = EagleConfig.from_hf_dict(raw, EagleLayout.EAGLE3, TARGET.num_layers)
    state = init_head(config, seed=0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (2, N)))
    features = jnp.asarray(rng.standard_normal((2, N, config.feature_size)), jnp.float32)
    hidden = jnp.asarray(rng.standard_normal((2, N, H)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((2, N, V)) * 3, jnp.float32)
    labels = sparse_labels(logits, state.d2t, jnp.ones((2, N), bool))

    class _State:  # head_loss merges target_state.module(); the stand-in needs no params
        def module(self) -> _Target:
            return _Target(jax.random.key(1))

    def loss(params: object) -> jax.Array:
        return head_loss(params, state, _State(), features, hidden, tokens,  # type: ignore[arg-type]
                         labels, 2, LossWeights())[0]

    optimizer = optax.adam(3e-3)
    params, opt_state = state.params, optax.adam(3e-3).init(state.params)
    first = float(jax.jit(loss)(params))

    @jax.jit
    def update(params: object, opt_state: object) -> tuple[object, object]:
        updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(30):
        params, opt_state = update(params, opt_state)
    assert float(jax.jit(loss)(params)) < 0.8 * first


def test_padding_positions_count_nowhere_in_the_loss() -> None:
    raw = eagle_config_dict(TARGET, EagleLayout.EAGLE3, aux_layer_ids=(2, 3, 4),
                            draft_vocab_size=30)
    config = EagleConfig.from_hf_dict(raw, EagleLayout.EAGLE3, TARGET.num_layers)
    state = init_head(config, seed=0, scale=0.3)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (1, N))
    features = rng.standard_normal((1, N, config.feature_size)).astype(np.float32)
    logits = jnp.asarray(rng.standard_normal((1, N, V)) * 3, jnp.float32)
    real = 7
    valid = jnp.arange(N)[None, :] < real

    class _State:
        def module(self) -> _Target:
            return _Target(jax.random.key(1))

    def loss(tokens: np.ndarray, features: np.ndarray, logits: jax.Array) -> float:
        labels = sparse_labels(logits, state.d2t, valid)
        return float(head_loss(state.params, state, _State(),  # type: ignore[arg-type]
                               jnp.asarray(features), jnp.zeros(0), jnp.asarray(tokens),
                               labels, 3, LossWeights())[0])

    before = loss(tokens, features, logits)
    tokens[0, real:] = rng.integers(0, V, N - real)
    features[0, real:] = 100.0
    after = loss(tokens, features, logits.at[0, real:].set(7.0))
    assert after == pytest.approx(before, rel=1e-6)
    # Not a loss that ignores everything: a real position's label moves it.
    assert loss(tokens, features, logits.at[0, 3].set(-logits[0, 3])) != pytest.approx(before)
