"""Sampling options through the whole engine, checked against a torch reference."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from esurge import SamplingParams, eSurge
from esurge.errors import InvalidRequestError, RequestField
from tests.engine.conftest import mixed_prompts

PROMPT = mixed_prompts()[5]


@pytest.fixture(scope="module")
def ref_model(tiny_llama_dir: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").eval()


def ref_logprobs(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """[len(ids), V] log-softmax of the reference logits at every position."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_seed_reproducible_alone_and_in_busy_batch(engine: eSurge) -> None:
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = engine.generate([PROMPT], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True)] * 6
    busy = engine.generate([*mixed_prompts()[:6], PROMPT], [*others, params])
    assert busy[-1].outputs[0].token_ids == alone
    unseeded = engine.generate([PROMPT] * 4, SamplingParams(temperature=1.0, max_tokens=16,
                                                            ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_logprobs_match_reference(engine: eSurge, ref_model: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    out = engine.generate([PROMPT], params)[0]
    gen = out.outputs[0].token_ids
    ref = ref_logprobs(ref_model, PROMPT + gen)
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(gen)
    for i, (token, entry) in enumerate(zip(gen, lps, strict=True)):
        row = ref[len(PROMPT) - 1 + i]
        assert entry.token_ids[0] == token and entry.rank == 1
        np.testing.assert_allclose(entry.logprobs[0], row[token], atol=1e-4)
        assert list(entry.token_ids[1:]) == np.argsort(-row)[:5].tolist()
        np.testing.assert_allclose(entry.logprobs[1:], np.sort(row)[::-1][:5], atol=1e-4)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    for pos in range(1, len(PROMPT)):
        entry = plp[pos]
        assert entry is not None and entry.token_ids[0] == PROMPT[pos]
        np.testing.assert_allclose(entry.logprobs[0], ref[pos - 1][PROMPT[pos]], atol=1e-4)
        assert len(entry.token_ids) == 4
    # n samples share one prompt: its logprobs come once, not once per sample.
    [many] = engine.generate([PROMPT], SamplingParams(n=3, max_tokens=2, prompt_logprobs=0))
    assert many.prompt_logprobs is not None and len(many.prompt_logprobs) == len(PROMPT)


def test_prompt_logprobs_scored_over_several_calls_per_step(
        engine: eSurge, ref_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's prompt rows are scored a bounded number at a time (3 here, so a
    16-token prefill chunk takes six calls, the last one partly padding)."""
    from esurge.runner import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_CALL", 3)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    plp = engine.generate([PROMPT], params)[0].prompt_logprobs
    ref = ref_logprobs(ref_model, PROMPT)
    assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
    for pos in range(1, len(PROMPT)):
        entry = plp[pos]
        assert entry is not None and entry.token_ids[0] == PROMPT[pos]
        np.testing.assert_allclose(entry.logprobs[0], ref[pos - 1][PROMPT[pos]], atol=1e-4)
        assert list(entry.token_ids[1:]) == np.argsort(-ref[pos - 1])[:2].tolist()
    # A one-token prompt has nothing to score: its one entry is None.
    [one] = engine.generate([[PROMPT[0]]], params)
    assert one.prompt_logprobs == [None] and len(one.outputs[0].token_ids) == 1


def test_penalties_follow_reference_loop(engine: eSurge, ref_model: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    got = engine.generate([PROMPT], params)[0].outputs[0].token_ids
    ids, out = list(PROMPT), []
    for _ in range(12):
        with torch.no_grad():
            logits = ref_model(torch.tensor([ids])).logits[0, -1].double().numpy()
        seen = np.zeros_like(logits, bool)
        seen[ids] = True
        logits = np.where(seen, np.where(logits > 0, logits / 1.3, logits * 1.3), logits)
        counts = np.bincount(out, minlength=len(logits)).astype(float)
        logits = logits - 1.5 * counts - 0.5 * (counts > 0)
        token = int(np.argmax(logits))
        out.append(token)
        ids.append(token)
    assert got == out


def test_stop_conditions(engine: eSurge) -> None:
    eos = 2
    first = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    greedy_first = first.outputs[0].token_ids[0]
    outs = engine.generate([PROMPT] * 5, [
        SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}),
        SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[greedy_first]),
        SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[10, 11]),
    ])
    eos_now, eos_late, ignored, stop_tok, allowed = (o.outputs[0] for o in outs)
    assert eos_now.token_ids == [eos] and eos_now.finish_reason == "stop"
    assert eos_now.stop_reason is None
    assert len(eos_late.token_ids) == 6 and eos_late.token_ids[-1] == eos
    assert eos not in eos_late.token_ids[:5]
    assert ignored.token_ids == [eos] * 8 and ignored.finish_reason == "length"
    assert stop_tok.token_ids == [greedy_first] and stop_tok.stop_reason == greedy_first
    assert set(allowed.token_ids) <= {10, 11} and len(allowed.token_ids) == 8


def test_the_largest_temperature_keeps_the_masks(engine: eSurge) -> None:
    """At the largest accepted temperature sampling is uniform but still inside
    allowed_token_ids and top_k; past it, refused. (float32's maximum was
    accepted: the compiled sampler's 1 / T flushed to zero, the masks turned to
    NaN, and the output was token 0 every time, outside the allowed set.)"""
    from esurge.sampling_params import MAX_TEMPERATURE

    hot = SamplingParams(temperature=MAX_TEMPERATURE, max_tokens=8, seed=3, ignore_eos=True,
                         allowed_token_ids=[10, 11, 12])
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    allowed, top = engine.generate([PROMPT] * 2, [hot, greedy])
    assert set(allowed.outputs[0].token_ids) <= {10, 11, 12}
    assert len(set(allowed.outputs[0].token_ids)) > 1  # uniform, not argmax
    first_top2 = set(top.outputs[0].logprobs[0].token_ids[1:])  # the sampled one, then the top
    top_k = replace(hot, allowed_token_ids=None, top_k=2, max_tokens=1)
    for seed in range(4):
        out = engine.generate([PROMPT], replace(top_k, seed=seed))[0].outputs[0].token_ids
        assert out[0] in first_top2
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(temperature=MAX_TEMPERATURE * 10)
    assert refused.value.field == RequestField.sampling("temperature")


def test_an_allow_list_the_bans_empty(engine: eSurge) -> None:
    """allowed_token_ids minus what min_tokens and the bad words ban: empty from the
    start, refused naming the field; emptied later by a multi-token bad word, the
    allow-list wins. (Both used to sample a token outside the list.)"""
    eos = 2
    cases = [
        (SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[eos]), "min_tokens"),
        (SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[7, eos],
                        stop_token_ids=[7]), "min_tokens"),
        (SamplingParams(max_tokens=4, allowed_token_ids=[10]).with_bad_words_token_ids(
            ((10,),)), "allowed_token_ids"),
    ]
    for params, field in cases:
        with pytest.raises(InvalidRequestError) as refused:
            engine.generate([PROMPT], params)
        assert refused.value.field == RequestField.sampling(field)
    ok = SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[eos], ignore_eos=True)
    assert engine.generate([PROMPT], ok)[0].outputs[0].token_ids == [eos] * 4
    later = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                           allowed_token_ids=[10]).with_bad_words_token_ids(((10, 10),))
    assert engine.generate([PROMPT], later)[0].outputs[0].token_ids == [10] * 4
    # ... and min_tokens too: dropping every ban let EOS (biased to win) end it at 2.
    both = replace(later, min_tokens=4, max_tokens=6, ignore_eos=False,
                   allowed_token_ids=[10, eos], logit_bias={eos: 50.0})
    out = engine.generate([PROMPT], both)[0].outputs[0]
    assert out.token_ids[:4] == [10] * 4 and out.finish_reason == "stop"
    assert len(out.token_ids) <= 5


def test_bad_words_ban_token_sequences(engine: eSurge) -> None:
    base = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4,
                                                    ignore_eos=True))[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    banned = banned.with_bad_words_token_ids(((base[0],),))
    out = engine.generate([PROMPT], banned)[0].outputs[0].token_ids
    assert out[0] != base[0] and base[0] not in out


def test_text_stop_strings_and_stream(engine: eSurge) -> None:
    prompt = "def main(self):\n    return"
    full = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                    ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    kept = engine.generate([prompt], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]
    deltas = list(engine.stream(prompt, SamplingParams(temperature=0, max_tokens=24,
                                                       ignore_eos=True)))
    assert deltas[-1].finished
    assert "".join(d.outputs[0].text for d in deltas) == full.text
    streamed = [t for d in deltas for t in d.outputs[0].token_ids]
    assert streamed == full.token_ids


def test_parallel_samples_and_abort(engine: eSurge) -> None:
    out = engine.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10,
                                                   ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    stream = engine.stream(PROMPT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    first = next(stream)
    assert not first.finished
    stream.close()  # abandoning the stream aborts the request
    engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))
    assert engine.scheduler.get_request_counts() == (0, 0)
    assert engine.scheduler.kv_cache_manager.usage == 0.0


def test_bad_input_is_rejected_with_named_field(engine: eSurge) -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 2, 100000]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([PROMPT], SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([PROMPT], SamplingParams(stop_token_ids=[4096]))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    # The engine still serves after refusing bad input.
    assert engine.generate([PROMPT], SamplingParams(max_tokens=2))[0].finished


def test_streamed_deltas_keep_the_delta_names(engine: eSurge) -> None:
    # The README's streaming example reads delta_text; it is the delta's text.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    deltas = list(engine.stream(PROMPT, params))
    full = engine.generate([PROMPT], params)[0].outputs[0]
    assert "".join(d.outputs[0].delta_text for d in deltas) == full.text
    assert [t for d in deltas for t in d.outputs[0].delta_token_ids] == full.token_ids
