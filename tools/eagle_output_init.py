"""Start an EAGLE-3 head's output layer from the target's own.

An EAGLE-3 head ends in RMSNorm and an LM head over its draft vocabulary.
Trained from random values, that LM head (draft_vocab x hidden: 4.7M numbers
for SmolLM2 with 8,192 draft tokens) is what a few hundred thousand training
tokens fit worst: a word the answers about the training topics rarely use
keeps a row that was barely trained, and prompts about other topics use such
words. The target's final norm and LM head rows for the draft tokens already
map hidden states to exactly those tokens, so the head can start from them
(`--output-init target`) and, optionally, keep them (`--freeze-output`): the
head then learns to produce hidden states in the target's final space.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from esurge.models.loader import LoadedModel
from esurge.spec_decode.head import HeadParams

__all__ = ["OUTPUT_MODULES", "freeze_output", "target_output_params"]

# The head's output layer: its final norm and its LM head.
OUTPUT_MODULES = ("norm", "lm_head")


def _target_lm_rows(target: LoadedModel, token_ids: np.ndarray) -> jax.Array:
    """The target's LM head rows [len(token_ids), H] for these tokens, read through
    the model's own logits (tied, packed or coded heads alike): the logits of the
    identity are the head's transpose; soft-capping is undone."""
    model = target.model_state.module()
    hidden = model.config.hidden_size
    logits = model.compute_logits(jnp.eye(hidden, dtype=jnp.float32))  # [H, vocab]
    cap = model.config.final_softcap
    if cap is not None:
        logits = jnp.arctanh(logits / cap) * cap
    return logits[:, jnp.asarray(token_ids)].T


def target_output_params(params: HeadParams, target: LoadedModel, d2t: np.ndarray
                         ) -> HeadParams:
    """params with the head's norm and LM head taken from the target's final norm and
    its LM head rows for the draft vocabulary (draft token d is target d + d2t[d])."""
    model = target.model_state.module()
    norm = model.model.norm
    weight = norm.weight[...].astype(jnp.float32)
    if norm.offset:  # the head's norm scales by its weight alone
        weight = 1.0 + weight
    draft_ids = np.arange(len(d2t)) + np.asarray(d2t)
    rows = _target_lm_rows(target, draft_ids)
    head_norm, head_lm = params["norm"]["weight"], params["lm_head"]["weight"]
    if rows.shape != head_lm.shape or weight.shape != head_norm.shape:
        raise ValueError(f"the target's output layer {tuple(rows.shape)} does not fit the "
                         f"head's {tuple(head_lm.shape)}")
    out = dict(params)
    out["norm"] = {**params["norm"], "weight": weight.astype(head_norm.dtype)}
    out["lm_head"] = {**params["lm_head"], "weight": rows.astype(head_lm.dtype)}
    return out


def freeze_output(optimizer: optax.GradientTransformation, params: HeadParams
                  ) -> optax.GradientTransformation:
    """optimizer for every parameter but the output layer's, which stays as it is."""
    labels: dict[str, Any] = {
        name: jax.tree_util.tree_map(
            lambda _, frozen=name in OUTPUT_MODULES: "frozen" if frozen else "trained", sub)
        for name, sub in params.items()}
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()},
                                 labels)
