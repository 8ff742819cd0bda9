"""Verification picks the target's greedy tokens on the real requests' rows only
(where the backend loops over rows): a lone request in a bucket of 4 has 5 of
its 20 logits rows; the real request's outcome is that of a pass over every row."""

from __future__ import annotations

import jax
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
                         NO_BUFFER, np.full(BUCKET, -1, np.int32), SamplerVariant(), VOCAB,
                         np.int32(num_rows), NO_FOLLOW, NO_REJECTED, FEEDBACK)
        if num_rows == K + 1:  # what a step dispatched before this one is read takes from it
            assert out.last_tokens is not None and out.rejected is not None
            assert np.asarray(out.last_tokens).shape == (FEEDBACK,)
            assert (int(out.last_tokens[0]), int(out.rejected[0])) == (int(target[2]), K - 2)
            assert not np.asarray(out.rejected)[1:].any()
        return np.asarray(out.token_ids), np.asarray(out.num_out)

    every_tokens, every_num = run(BUCKET * (K + 1))
    tokens, num = run(K + 1)
    assert num[0] == every_num[0] == 3
    assert tokens[0, :3].tolist() == every_tokens[0, :3].tolist() == target[:3].tolist()
    # The padding requests' rows were never picked from.
    assert not tokens[1:].any() and every_tokens[1:].any()


NO_BUFFER = jnp.zeros((BUCKET + 1, K), jnp.int32)
FEEDBACK = 8  # the runner's rows, past the bucket
NO_FOLLOW = np.full(BUCKET, -1, np.int32)  # no request follows a step in flight
NO_REJECTED = jnp.zeros(FEEDBACK, jnp.int32)


def test_drafts_kept_on_the_device_are_verified_as_drafts_from_the_host() -> None:
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(BUCKET * (K + 1), VOCAB)), jnp.float32)
    target = np.asarray(logits).argmax(-1).reshape(BUCKET, K + 1)
    drafts = target[:, :K].astype(np.int32).copy()
    drafts[1, 1] = (drafts[1, 1] + 1) % VOCAB  # request 1's second draft is wrong
    num_drafts = np.full(BUCKET, K, np.int32)
    probs = jnp.zeros((BUCKET + 1, K, VOCAB), jnp.float32)
    slots = np.full(BUCKET, BUCKET, np.int32)

    def run(host: np.ndarray, buffer: jax.Array, draft_slots: np.ndarray) -> list[list[int]]:
        out = verify_jit(logits, _greedy_tensors(BUCKET), host, num_drafts, probs, slots,
                         buffer, draft_slots, SamplerVariant(), VOCAB, np.int32(BUCKET * (K + 1)),
                         NO_FOLLOW, NO_REJECTED, FEEDBACK)
        num = np.asarray(out.num_out)
        return [np.asarray(out.token_ids)[i, :num[i]].tolist() for i in range(BUCKET)]

    from_host = run(drafts, NO_BUFFER, np.full(BUCKET, -1, np.int32))
    # Requests 0 and 1 keep their drafts in slots 3 and 0 of the buffer; the
    # host's copies of those are stale zeros.
    buffer = NO_BUFFER.at[3].set(drafts[0]).at[0].set(drafts[1])
    stale = drafts.copy()
    stale[:2] = 0
    from_device = run(stale, buffer, np.array([3, 0, -1, -1], np.int32))
    assert from_device == from_host
    assert [len(t) for t in from_host] == [K + 1, 2, K + 1, K + 1]
