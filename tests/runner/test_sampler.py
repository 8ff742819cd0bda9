"""On-device sampling: each option changes outputs exactly as defined."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from esurge.runner.device_step import sampled_logprobs_step
from esurge.runner.sampler import MAX_LOGPROBS, sample_jit
from esurge.runner.sampling_batch import SamplingBatch
from esurge.sampling_params import SamplingParams

V = 32


def run(logits: np.ndarray, params: list[SamplingParams], *, prompt: list[int] | None = None,
        outputs: list[list[int]] | None = None, eos: int | None = None,
        positions: np.ndarray | None = None) -> tuple[np.ndarray, object]:
    rows = len(params)
    batch = SamplingBatch(rows, V)
    for i, p in enumerate(params):
        out = outputs[i] if outputs else []
        batch.set_row(i, p, prompt or [0], out, eos)
    order = np.arange(rows)
    variant = batch.variant(order)
    pos = positions if positions is not None else np.zeros(rows, np.int32)
    tensors = batch.tensors(order, rows, pos, variant)
    result = sample_jit(jnp.asarray(logits), tensors, variant)
    return np.asarray(result.token_ids), result


def base_logits(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.tile(rng.normal(size=V).astype(np.float32) * 2, (rows, 1))


def test_greedy_is_argmax() -> None:
    logits = np.random.default_rng(1).normal(size=(4, V)).astype(np.float32)
    tokens, _ = run(logits, [SamplingParams(temperature=0)] * 4)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_seed_reproducible_regardless_of_batch() -> None:
    logits = base_logits(6)
    alone, _ = run(logits[:1], [SamplingParams(seed=1234)])
    mixed_params = [SamplingParams(temperature=0), SamplingParams(seed=7), SamplingParams(),
                    SamplingParams(seed=1234, top_k=V), SamplingParams(top_p=0.5, seed=3),
                    SamplingParams(seed=1234)]
    busy, _ = run(logits, mixed_params)
    assert busy[5] == alone[0] and busy[3] == alone[0]
    # Different output positions draw different noise.
    seqs = [run(logits[:1], [SamplingParams(seed=1234)], positions=np.array([p]))[0][0]
            for p in range(40)]
    assert len(set(seqs)) > 3


def many(params: SamplingParams, n: int = 4000, logits_row: np.ndarray | None = None) -> np.ndarray:
    row = base_logits(1)[0] if logits_row is None else logits_row
    logits = np.tile(row, (n, 1))
    plist = [dataclasses.replace(params, seed=i) for i in range(n)]
    tokens, _ = run(logits, plist)
    return tokens


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_top_k_never_leaves_the_top_k() -> None:
    row = base_logits(1)[0]
    tokens = many(SamplingParams(top_k=3), logits_row=row)
    assert set(tokens.tolist()) == set(np.argsort(-row)[:3].tolist())


def test_top_p_keeps_the_nucleus_only() -> None:
    row = base_logits(1)[0]
    probs = softmax(row)
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[mass_before < 0.6].tolist())
    tokens = many(SamplingParams(top_p=0.6), logits_row=row)
    assert set(tokens.tolist()) == nucleus


def test_min_p_drops_unlikely_tokens() -> None:
    row = base_logits(1)[0]
    probs = softmax(row)
    kept = set(np.nonzero(probs >= 0.2 * probs.max())[0].tolist())
    tokens = many(SamplingParams(min_p=0.2), logits_row=row)
    assert set(tokens.tolist()) == kept


def test_plain_sampling_follows_softmax() -> None:
    row = np.linspace(-1, 1, V).astype(np.float32)
    tokens = many(SamplingParams(temperature=0.5), n=8000, logits_row=row)
    expected = softmax(row / 0.5)
    observed = np.bincount(tokens, minlength=V) / len(tokens)
    assert np.abs(observed - expected).max() < 0.02


def test_penalties_exact() -> None:
    logits = np.zeros((1, V), np.float32)
    logits[0, :6] = [3.0, 2.7, 2.76, -1.0, 0.5, 0.4]
    # Token 0 appears twice in the output: 3.0 - 0.1*2 - 0.05 = 2.75 < 2.76.
    params = SamplingParams(temperature=0, presence_penalty=0.05, frequency_penalty=0.1)
    tokens, _ = run(logits, [params], prompt=[9], outputs=[[0, 0]])
    assert tokens[0] == 2
    # Presence alone (3.0 - 0.05) keeps token 0 on top; penalties ignore the prompt.
    presence = SamplingParams(temperature=0, presence_penalty=0.05)
    tokens, _ = run(logits, [presence], prompt=[0], outputs=[[0, 0]])
    assert tokens[0] == 0
    # Repetition penalty divides positive logits of seen tokens (prompt included).
    rp = SamplingParams(temperature=0, repetition_penalty=2.0)
    tokens, _ = run(logits, [rp], prompt=[0, 1], outputs=[[]])
    assert tokens[0] == 2
    # ... and multiplies negative ones: -1 * 2 = -2 keeps token 3 below everything.
    logits2 = np.full((1, V), -1.5, np.float32)
    logits2[0, 3] = -1.0
    tokens, _ = run(logits2, [rp], prompt=[3], outputs=[[]])
    assert tokens[0] != 3


def test_logit_bias_allowed_and_bad_words() -> None:
    logits = np.arange(V, dtype=np.float32)[None, :]
    tokens, _ = run(logits, [SamplingParams(temperature=0, logit_bias={2: 100.0})])
    assert tokens[0] == 2
    tokens = many(SamplingParams(allowed_token_ids=[4, 5]))
    assert set(tokens.tolist()) <= {4, 5}
    single = SamplingParams(temperature=0).with_bad_words_token_ids(((V - 1,),))
    tokens, _ = run(logits, [single])
    assert tokens[0] == V - 2
    # A two-token bad word bans its last token only right after its prefix.
    pair = SamplingParams(temperature=0).with_bad_words_token_ids(((7, V - 1),))
    tokens, _ = run(np.repeat(logits, 2, 0), [pair, pair], outputs=[[7], [8]])
    assert tokens.tolist() == [V - 2, V - 1]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = np.arange(V, dtype=np.float32)[None, :].repeat(3, 0)
    eos = V - 1
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[V - 2]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[V - 2]),
              SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)]
    tokens, _ = run(logits, params, outputs=[[1], [1, 1], [1]], eos=eos)
    assert tokens.tolist() == [V - 3, V - 1, V - 1]


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = np.random.default_rng(3).normal(size=(2, V)).astype(np.float32)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(seed=1, logprobs=0)]
    tokens, result = run(logits, params)
    ids = np.asarray(result.logprob_token_ids)
    lps = np.asarray(result.logprobs)
    ranks = np.asarray(result.ranks)
    assert ids.shape == (2, 1 + MAX_LOGPROBS)
    for r in range(2):
        ref = logits[r] - np.log(np.exp(logits[r]).sum())
        assert ids[r, 0] == tokens[r]
        np.testing.assert_allclose(lps[r], ref[ids[r]], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(ids[r, 1:], np.argsort(-ref)[:MAX_LOGPROBS])
        assert ranks[r] == int((ref > ref[tokens[r]]).sum()) + 1
    assert ranks[0] == 1


@pytest.mark.parametrize("bad", [{"temperature": 0, "top_k": 0}])
def test_invalid_options_rejected_before_sampling(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(**bad)  # type: ignore[arg-type]


def nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    return set(order[mass_before < top_p].tolist())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_filters_apply_to_the_tempered_distribution(temperature: float) -> None:
    # top-p and min-p cut the distribution the token is drawn from: the
    # logits divided by the temperature, not the raw ones.
    row = base_logits(1)[0]
    tempered = softmax(row / temperature)
    want_p, raw_p = nucleus(tempered, 0.6), nucleus(softmax(row), 0.6)
    assert want_p != raw_p  # so the order of the two steps shows
    got = many(SamplingParams(temperature=temperature, top_p=0.6), logits_row=row)
    assert set(got.tolist()) == want_p
    want_min = set(np.nonzero(tempered >= 0.2 * tempered.max())[0].tolist())
    raw = softmax(row)
    assert want_min != set(np.nonzero(raw >= 0.2 * raw.max())[0].tolist())
    got = many(SamplingParams(temperature=temperature, min_p=0.2), logits_row=row)
    assert set(got.tolist()) == want_min
    # Within a top-k cut the frequencies follow the tempered softmax.
    top = np.argsort(-row)[:3]
    expected = softmax(row[top] / temperature)
    got = many(SamplingParams(temperature=temperature, top_k=3), n=8000, logits_row=row)
    observed = np.array([(got == t).mean() for t in top])
    assert np.abs(observed - expected).max() < 0.03


def test_repetition_penalty_counts_generated_tokens() -> None:
    # Token 0 was generated (never in the prompt): 3.0 / 2 = 1.5 drops it below 2.76.
    logits = np.zeros((1, V), np.float32)
    logits[0, :3] = [3.0, 2.7, 2.76]
    rp = SamplingParams(temperature=0, repetition_penalty=2.0)
    tokens, _ = run(logits, [rp], prompt=[9], outputs=[[0]])
    assert tokens[0] == 2
    unseen, _ = run(logits, [rp], prompt=[9], outputs=[[5]])
    assert unseen[0] == 0
    # A token observed after the row joined counts the same.
    batch = SamplingBatch(1, V)
    batch.set_row(0, rp, [9], [], None)
    batch.observe(0, [0])
    order = np.arange(1)
    variant = batch.variant(order)
    tensors = batch.tensors(order, 1, np.zeros(1, np.int32), variant)
    assert int(np.asarray(sample_jit(jnp.asarray(logits), tensors, variant).token_ids)[0]) == 2


def test_the_top_uniform_draw_never_picks_a_masked_token() -> None:
    """uniform_noise's top value, 1 - 2**-25, rounded to 1.0 in float32: its Gumbel
    noise was +inf, a masked token's -inf + inf was NaN, and argmax took the NaN,
    so about once in 2**24 draws per masked token the sampler left
    allowed_token_ids (the gRPC fuzz test found it with n=3 and random seeds)."""
    from esurge.runner.sampler import gumbel_noise, uniform_noise

    vocab, column = 1 << 17, 89_231
    words = jnp.asarray([[28, 197]], jnp.uint32)  # hit the top value at that column
    zero = jnp.zeros(1, jnp.int32)
    u = uniform_noise(words, zero, vocab)
    assert int(jnp.argmax(u[0])) == column and float(u[0, column]) < 1.0
    assert bool(jnp.isfinite(gumbel_noise(words, zero, vocab)).all())
    batch = SamplingBatch(1, vocab)
    batch.set_row(0, SamplingParams(seed=28 | (197 << 32), allowed_token_ids=[5]), [0], [],
                  None)
    order = np.arange(1)
    variant = batch.variant(order)
    tensors = batch.tensors(order, 1, np.zeros(1, np.int32), variant)
    tokens = sample_jit(jnp.zeros((1, vocab), jnp.float32), tensors, variant).token_ids
    assert int(tokens[0]) == 5


def test_the_logprobs_program_gives_what_the_logprobs_variant_gives() -> None:
    """The sampled step takes logprobs from a program of their own
    (sampled_logprobs_step): the same ids, values and ranks as a sampler
    variant with logprobs, over grammar-masked logits too."""
    logits = np.random.default_rng(5).normal(size=(3, V)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(seed=2, logprobs=3),
              SamplingParams(temperature=0.8, top_p=0.9, logprobs=1)]
    batch = SamplingBatch(3, V)
    for i, p in enumerate(params):
        batch.set_row(i, p, [0], [], None)
    order = np.arange(3)
    variant = batch.variant(order)
    assert variant.logprobs
    allowed = np.full((3, 1), -1, np.int32)
    allowed[1, 0] = 0x0F0F0F0F  # a grammar allowing half the vocabulary
    tensors = dataclasses.replace(batch.tensors(order, 3, np.zeros(3, np.int32), variant),
                                  allowed=allowed)
    want = sample_jit(jnp.asarray(logits), tensors, variant)
    without = sample_jit(jnp.asarray(logits), tensors,
                         dataclasses.replace(variant, logprobs=False))
    np.testing.assert_array_equal(np.asarray(without.token_ids), np.asarray(want.token_ids))
    assert without.logprobs is None
    ids, lps, ranks = sampled_logprobs_step(jnp.asarray(logits), allowed, without.token_ids,
                                            jnp.int32(3))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want.logprob_token_ids))
    np.testing.assert_array_equal(np.asarray(ranks), np.asarray(want.ranks))
    np.testing.assert_allclose(np.asarray(lps), np.asarray(want.logprobs), rtol=1e-6, atol=1e-6)
    # The masked row: the grammar's tokens finite, the rest of its top ids -inf.
    masked = [bool((0x0F0F0F0F >> int(t)) & 1) for t in np.asarray(ids)[1]]
    np.testing.assert_array_equal(np.isfinite(np.asarray(lps)[1]), masked)
    assert not all(masked)
