"""Training an Eagle head on a target's features, with the drafting unrolled.

`head_loss` runs the draft `num_steps` times over a batch of windows, the way
the proposer runs it at inference ("training-time test"): step 1 at position
p reads the target's feature at p and token p + 1; step s > 1 at position p
reads step s - 1's output at p - 1 instead of a target feature. Its
attention sees what it would see at inference: step-1 keys up to the round's
anchor p - s + 1 (the last position with a target feature) and, of every
later step j <= s, the single key that step wrote at p - s + j.

Every step is trained to put the target's next-token distribution at p + 1
on its own LM head (cross-entropy with the target's probabilities as soft
labels, restricted to the draft vocabulary for EAGLE-3); EAGLE-1 heads also
regress their output onto the target's feature at p + 1, since that output is
both their next hidden input and, through the target's LM head, their logits.

The soft labels are the target's `LABEL_TOP` most likely draft tokens per
position, renormalised (`Labels`): a greedy target puts nearly all its mass
there, and sparse labels can be computed once per token and kept
(tools/eagle_data.py) where a full distribution over a 49k vocabulary could not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from esurge.models.forward import ModelState
from esurge.models.rope import rope_cos_sin
from esurge.spec_decode.config import EagleLayout
from esurge.spec_decode.head import EagleHead, EagleState, HeadParams

__all__ = ["LABEL_TOP", "Labels", "LossWeights", "StepMetrics", "head_loss", "make_train_step",
           "sparse_labels", "unrolled_steps"]

LABEL_TOP = 8  # draft tokens kept per position as soft labels


@dataclass(frozen=True, slots=True)
class LossWeights:
    """Weight of step s's loss is step_decay ** (s - 1); regression is EAGLE-1 only."""

    step_decay: float = 0.8
    regression: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay!r}")
        if self.regression < 0.0:
            raise ValueError(f"regression must be >= 0, got {self.regression!r}")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Labels:
    """The target's next-token distribution per position, sparse over the draft vocabulary.

    Position p holds what the target predicts after token p (its logits at p).
    """

    ids: jax.Array  # [B, L, LABEL_TOP] int32: draft-vocabulary indices, most likely first
    probs: jax.Array  # [B, L, LABEL_TOP] float32, summing to 1 per position
    valid: jax.Array  # [B, L] bool: a real position (not padding)


@partial(jax.jit, static_argnames=("top",))
def sparse_labels(target_logits: jax.Array, d2t: jax.Array, valid: jax.Array,
                  top: int = LABEL_TOP) -> Labels:
    """Labels from the target's logits [B, L, V] over the draft vocabulary d2t [Vd]."""
    draft_ids = jnp.arange(d2t.shape[0]) + d2t
    probs = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)[..., draft_ids]
    kept, ids = jax.lax.top_k(probs, top)
    kept = kept / jnp.maximum(kept.sum(-1, keepdims=True), 1e-9)
    return Labels(ids.astype(jnp.int32), kept, valid)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepMetrics:
    """Per-step training signals ([num_steps] each)."""

    loss: jax.Array  # soft cross-entropy per draft step
    accuracy: jax.Array  # draft argmax == target argmax, per draft step


class _UnrolledAttend:
    """Dense attention of draft step `step` (1-based) over the keys an inference round
    would hold; keys of earlier steps are kept per layer in `memory`."""

    def __init__(self, memory: dict[int, list[tuple[jax.Array, jax.Array]]], step: int,
                 batch: int, length: int, scale: float) -> None:
        self.memory, self.step = memory, step
        self.batch, self.length, self.scale = batch, length, scale

    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        # q: [T, heads, D], k/v: [T, kv_heads, D] with T = batch * length
        b, n = self.batch, self.length
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        q4, k4, v4 = (x.reshape(b, n, -1, d) for x in (q, k, v))
        history = self.memory.setdefault(layer, [])
        history.append((k4, v4))
        group = heads // kv_heads
        qg = q4.reshape(b, n, kv_heads, group, d)
        s = self.step
        pos = jnp.arange(n)
        k1, v1 = history[0]
        scores = [jnp.einsum("bqkgd,bpkd->bkgqp", qg, k1)]
        visible = [pos[None, :] <= pos[:, None] - (s - 1)]  # [n, n]
        values = []
        for j in range(2, s + 1):
            kj, vj = history[j - 1]
            shift = s - j  # step j's key for query p sits at p - shift
            kj = jnp.roll(kj, shift, axis=1)
            values.append(jnp.roll(vj, shift, axis=1))
            scores.append(jnp.einsum("bqkgd,bqkd->bkgq", qg, kj)[..., None])
            visible.append((pos >= shift)[:, None])
        mask = jnp.concatenate(visible, axis=1)  # [n, n + s - 1]
        logits = jnp.concatenate(scores, axis=-1).astype(jnp.float32) * self.scale
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
        probs = jnp.where(mask, probs, 0.0).astype(v.dtype)
        out = jnp.einsum("bkgqp,bpkd->bqkgd", probs[..., :n], v1)
        for j, vj in enumerate(values):
            out = out + probs[..., n + j].transpose(0, 3, 1, 2)[..., None] * vj[:, :, :, None]
        return out.reshape(b * n, heads, d)


def unrolled_steps(head: EagleHead, target: Any, features: jax.Array, tokens: jax.Array,
                   num_steps: int) -> list[jax.Array]:
    """Each draft step's output hidden state [B, L, H] (see the module docstring)."""
    # features: [B, L, F], tokens: [B, L] int32
    config = head.config
    b, n = tokens.shape
    following = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)  # token p + 1
    embeds = head.embed(following.reshape(-1), target)
    positions = jnp.arange(n)
    cos, sin = rope_cos_sin(config.rope, config.head_dim, positions, positions + 1)
    rope = (jnp.tile(cos, (b, 1)), jnp.tile(sin, (b, 1)))
    memory: dict[int, list[tuple[jax.Array, jax.Array]]] = {}
    hidden = head.first_hidden(features.reshape(b * n, -1))
    outputs = []
    for step in range(1, num_steps + 1):
        attend = _UnrolledAttend(memory, step, b, n, config.head_dim ** -0.5)
        out = head.step(hidden, embeds, rope, attend).reshape(b, n, -1)
        outputs.append(out)
        # The next step at p continues from this step's output at p - 1.
        hidden = jnp.concatenate([jnp.zeros_like(out[:, :1]), out[:, :-1]], axis=1)
        hidden = hidden.reshape(b * n, -1)
    return outputs


def head_loss(params: HeadParams, head_state: EagleState, target_state: ModelState,
              features: jax.Array, final_hidden: jax.Array, tokens: jax.Array,
              labels: Labels, num_steps: int, weights: LossWeights
              ) -> tuple[jax.Array, StepMetrics]:
    """Scalar loss and per-step metrics for one batch.

    features [B, L, F], final_hidden [B, L, H] (the target's normed hidden;
    EAGLE-1 only), tokens [B, L], labels of the target's next-token
    distributions (padding positions count nowhere).
    """
    head = head_state.replace_params(params).module()
    target = target_state.module()
    config = head.config
    n = tokens.shape[1]
    label_ids, label_probs = labels.ids[:, 1:], labels.probs[:, 1:]  # [B, L-1, K]
    real = labels.valid[:, 1:].astype(jnp.float32)  # [B, L-1]
    pos = jnp.arange(n - 1)
    total = jnp.zeros((), jnp.float32)
    losses, accuracies = [], []
    outputs = unrolled_steps(head, target, features.astype(jnp.float32), tokens, num_steps)
    for s, out in enumerate(outputs, start=1):
        valid = real * (pos >= s - 1)[None, :]  # the round has an anchor
        count = jnp.maximum(valid.sum(), 1.0)
        logp = jax.nn.log_softmax(head.logits(out[:, :-1], target), axis=-1)
        ce = -(label_probs * jnp.take_along_axis(logp, label_ids, axis=-1)).sum(-1)
        step_loss = (ce * valid).sum() / count
        accuracy = ((jnp.argmax(logp, -1) == label_ids[..., 0]) * valid).sum() / count
        weight = weights.step_decay ** (s - 1)
        total = total + weight * step_loss
        if config.layout is EagleLayout.EAGLE1 and weights.regression:
            err = optax.huber_loss(out[:, :-1].astype(jnp.float32),
                                   final_hidden[:, 1:].astype(jnp.float32)).mean(-1)
            total = total + weight * weights.regression * (err * valid).sum() / count
        losses.append(step_loss)
        accuracies.append(accuracy)
    return total, StepMetrics(jnp.stack(losses), jnp.stack(accuracies))


def make_train_step(optimizer: optax.GradientTransformation, num_steps: int,
                    weights: LossWeights) -> Any:
    """A jitted (params, opt_state, head, target, features, hidden, tokens, labels) ->
    (params, opt_state, loss, metrics) update."""

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params: HeadParams, opt_state: Any, head_state: EagleState,
                   target_state: ModelState, features: jax.Array, final_hidden: jax.Array,
                   tokens: jax.Array, labels: Labels
                   ) -> tuple[HeadParams, Any, jax.Array, StepMetrics]:
        grad_fn = jax.value_and_grad(head_loss, has_aux=True)
        (loss, metrics), grads = grad_fn(params, head_state, target_state, features,
                                         final_hidden, tokens, labels, num_steps, weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics

    return train_step
