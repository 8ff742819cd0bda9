"""Verification picks the target's greedy tokens on the real requests' rows only
(where the backend loops over rows): a lone request in a bucket of 4 has 5 of
its 20 logits rows; the real request's outcome is that of a pass over every row."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from esurge.runner.sampler import SamplerVariant, SamplingTensors
from esurge.runner.steps.speculative.verify import verify_jit

K, BUCKET, VOCAB = 4, 4, 300


def _greedy_tensors(requests: int) -> SamplingTensors:
    return SamplingTensors(
        temperature=jnp.zeros(requests, jnp.float32), top_k=jnp.full(requests, VOCAB, jnp.int32),
        top_p=jnp.ones(requests, jnp.float32), min_p=jnp.zeros(requests, jnp.float32),
        seeds=jnp.zeros((requests, 2), jnp.uint32), positions=jnp.zeros(requests, jnp.int32))


def test_verification_of_one_request_in_a_bucket_of_four() -> None:
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(BUCKET * (K + 1), VOCAB)), jnp.float32)
    target = np.asarray(logits).argmax(-1)
    drafts = np.zeros((BUCKET, K), np.int32)
    drafts[0, :2] = target[:2]  # two drafts agree with the target, the third does not
    drafts[0, 2] = (target[2] + 1) % VOCAB
    num_drafts = np.array([K, 0, 0, 0], np.int32)
    probs = jnp.zeros((BUCKET + 1, K, VOCAB), jnp.float32)
    slots = np.full(BUCKET, BUCKET, np.int32)

    def run(num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        out = verify_jit(logits, _greedy_tensors(BUCKET), drafts, num_drafts, probs, slots,
                         SamplerVariant(), VOCAB, np.int32(num_rows))
        return np.asarray(out.token_ids), np.asarray(out.num_out)

    every_tokens, every_num = run(BUCKET * (K + 1))
    tokens, num = run(K + 1)
    assert num[0] == every_num[0] == 3
    assert tokens[0, :3].tolist() == every_tokens[0, :3].tolist() == target[:3].tolist()
    # The padding requests' rows were never picked from.
    assert not tokens[1:].any() and every_tokens[1:].any()
