"""An EAGLE-3 head started from the target's output layer (`--output-init target`)
gives, on any hidden state, the target's own logits for its draft tokens; with
`--freeze-output` training leaves that layer as it is and trains the rest."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from esurge.models import load_model
from esurge.spec_decode.checkpoint import eagle_config_dict
from esurge.spec_decode.config import EagleConfig, EagleLayout
from esurge.spec_decode.head import init_head
from tools.eagle_output_init import freeze_output, target_output_params

TARGET = Path(__file__).resolve().parents[2] / "models" / "tiny-stdlib"
DRAFT_VOCAB = 64


def _target_and_head() -> tuple[object, object, np.ndarray]:
    target = load_model(TARGET, "float32")
    layout = EagleLayout.EAGLE3
    raw = eagle_config_dict(target.config, layout, aux_layer_ids=(2, 3, 4),
                            draft_vocab_size=DRAFT_VOCAB)
    config = EagleConfig.from_hf_dict(raw, layout, target.config.num_layers)
    # A scattered draft vocabulary, as the most frequent tokens would be.
    draft_ids = np.sort(np.random.default_rng(0).choice(target.config.vocab_size, DRAFT_VOCAB,
                                                        replace=False))
    d2t = draft_ids - np.arange(DRAFT_VOCAB)
    return target, init_head(config, seed=0, d2t=jnp.asarray(d2t)), d2t


def test_the_head_starts_with_the_targets_logits_for_its_draft_tokens() -> None:
    target, state, d2t = _target_and_head()
    started = state.replace_params(target_output_params(state.params, target, d2t))
    model = target.model_state.module()
    hidden = jax.random.normal(jax.random.key(0), (5, model.config.hidden_size)) * 3.0
    got = started.module().logits(hidden, model)  # [5, draft_vocab]
    expected = model.compute_logits(model.model.norm(hidden))[:, np.arange(DRAFT_VOCAB) + d2t]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-4)
    random_logits = state.module().logits(hidden, model)
    assert not np.allclose(np.asarray(random_logits), np.asarray(expected), atol=1e-2)


def test_a_frozen_output_layer_stays_while_the_rest_trains() -> None:
    target, state, d2t = _target_and_head()
    params = target_output_params(state.params, target, d2t)
    optimizer = freeze_output(optax.adam(1e-2), params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    moved = optax.apply_updates(params, updates)
    for name in ("norm", "lm_head"):
        np.testing.assert_array_equal(np.asarray(moved[name]["weight"]),
                                      np.asarray(params[name]["weight"]))
    assert not np.array_equal(np.asarray(moved["fc"]["weight"]),
                              np.asarray(params["fc"]["weight"]))
