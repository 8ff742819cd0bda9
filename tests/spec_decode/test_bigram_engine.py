"""Speculation with a head whose greedy drafts are always right (the bigram target):
long accepted runs, and everything around them (stops, length limits, prefix hits,
preemption, async flag, logprobs, metrics, warm-up) behaves as without drafts."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from esurge import SamplingParams, eSurge
from esurge.engine_types import FinishReason
from esurge.runner.device_step import model_step_features, prompt_logprobs_step
from esurge.runner.steps.speculative.verify import store_draft_probs, store_drafts, verify_jit
from esurge.spec_decode import proposer
from tests.spec_decode.conftest import BIGRAM_K
from tests.spec_decode.helpers import MAX_MODEL_LEN, bigram_next_probs, bigram_pair, spec_config

VOCAB = 16


def greedy_chain(probs: np.ndarray, prompt: list[int], n: int) -> list[int]:
    """The bigram target's greedy continuation (its next token depends on the last only)."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = int(np.argmax(probs[last]))
        out.append(last)
    return out


def prompts(n: int = 12, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(k)).tolist() for k in np.linspace(3, 50, n)]


@pytest.fixture(scope="module")
def probs(bigram_dirs: tuple[Path, Path]) -> np.ndarray:
    return bigram_next_probs(bigram_dirs[0])


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          **kw)  # type: ignore[arg-type]


def test_all_drafts_accepted_and_tokens_exact(bigram_engine: eSurge, probs: np.ndarray) -> None:
    before = bigram_engine.runner.spec_stats
    outs = bigram_engine.generate(prompts(), greedy(25))
    assert [o.outputs[0].token_ids for o in outs] == [greedy_chain(probs, p, 25)
                                                     for p in prompts()]
    after = bigram_engine.runner.spec_stats
    assert before is not None and after is not None
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    runs = after.num_verifications - before.num_verifications
    assert drafted == accepted > 0
    # 24 tokens after the prefill's first: 6 runs of 1 + k = 4 tokens per request.
    assert runs == 6 * len(outs) and (1 + accepted / runs) == pytest.approx(1 + BIGRAM_K)
    for out in outs:
        assert out.outputs[0].num_draft_tokens == out.outputs[0].num_accepted_tokens == 18


def test_the_next_step_reads_the_drafts_on_the_device(bigram_engine: eSurge, probs: np.ndarray,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from esurge.runner.steps.speculative import draft_slots

    # The step's proposals go back as soon as its verification is read, and the
    # next step takes them from the head's draft buffer: no draft reaches the host.
    reads: list[object] = []

    def counted(array: object) -> object:
        reads.append(array)
        return np.asarray(array)

    monkeypatch.setattr(draft_slots, "to_host", counted)
    before = bigram_engine.runner.spec_stats
    outs = bigram_engine.generate(prompts(seed=13), greedy(25))
    assert [o.outputs[0].token_ids for o in outs] == [greedy_chain(probs, p, 25)
                                                     for p in prompts(seed=13)]
    after = bigram_engine.runner.spec_stats
    assert before is not None and after is not None
    assert after.num_accepted_tokens - before.num_accepted_tokens > 0
    assert reads == []


def test_prefix_hits_keep_tokens(bigram_engine: eSurge, probs: np.ndarray) -> None:
    batch = prompts(seed=11)
    first = bigram_engine.generate(batch, greedy(9))
    again = bigram_engine.generate(batch, greedy(9))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert [o.outputs[0].token_ids for o in again] == [greedy_chain(probs, p, 9) for p in batch]
    assert all(o.num_cached_tokens == ((len(p) - 1) // 8) * 8
               for o, p in zip(again, batch, strict=True))


def test_stop_token_inside_an_accepted_run(bigram_engine: eSurge, probs: np.ndarray) -> None:
    prompt = [3, 1, 4, 1, 5]
    chain = greedy_chain(probs, prompt, 40)
    # A stop token whose first occurrence lies inside a run of drafts.
    position = next(i for i, t in enumerate(chain) if i % (BIGRAM_K + 1) not in (0, BIGRAM_K)
                    and t not in chain[:i])
    stop = chain[position]
    out = bigram_engine.generate([prompt], SamplingParams(
        temperature=0, max_tokens=40, stop_token_ids=(stop,)))[0].outputs[0]
    assert out.token_ids == chain[:position + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


@pytest.mark.parametrize("max_tokens", [2, 6, 11])
def test_max_tokens_cut_inside_a_run(bigram_engine: eSurge, probs: np.ndarray,
                                     max_tokens: int) -> None:
    out = bigram_engine.generate([[7, 8]], greedy(max_tokens))[0].outputs[0]
    assert out.token_ids == greedy_chain(probs, [7, 8], max_tokens)
    assert out.finish_reason == "length"


def test_max_model_len_edge(bigram_engine: eSurge, probs: np.ndarray) -> None:
    prompt = np.random.default_rng(2).integers(0, VOCAB, MAX_MODEL_LEN - 7).tolist()
    out = bigram_engine.generate([prompt], SamplingParams(temperature=0, ignore_eos=True,
                                                          max_tokens=None))
    tokens = out[0].outputs[0].token_ids
    assert len(prompt) + len(tokens) == MAX_MODEL_LEN
    assert tokens == greedy_chain(probs, prompt, 7)


def test_logprobs_and_n_samples(bigram_engine: eSurge, probs: np.ndarray) -> None:
    prompt = [2, 9, 4]
    out = bigram_engine.generate([prompt], greedy(10, logprobs=3, n=2))[0]
    expected = greedy_chain(probs, prompt, 10)
    for sample in out.outputs:
        assert sample.token_ids == expected
        assert sample.logprobs is not None and len(sample.logprobs) == 10
        previous = prompt[-1]
        for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
            assert entry.token_ids[0] == token and entry.rank == 1 and len(entry.token_ids) == 4
            assert entry.logprobs[0] == pytest.approx(np.log(probs[previous, token]), abs=1e-4)
            previous = token


def test_seeded_sampling_ignores_batch_company(bigram_engine: eSurge) -> None:
    params = SamplingParams(temperature=1.3, top_p=0.95, seed=77, max_tokens=20, ignore_eos=True)
    alone = bigram_engine.generate([[4, 4, 2]], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=i, max_tokens=15) for i in range(5)]
    crowd = bigram_engine.generate([*prompts(5, seed=8), [4, 4, 2]], [*others, params])
    assert crowd[-1].outputs[0].token_ids == alone


def test_aborts_and_arrivals_while_a_verification_is_in_flight(bigram_engine: eSurge,
                                                                probs: np.ndarray) -> None:
    # After a speculative step the engine dispatches the next before the loop
    # handles the outputs: an abort or a new request made from an output's
    # callback meets a speculative step already on the device.
    batch = prompts(6, seed=21)
    late = [7, 3, 9]
    done: dict[str, threading.Event] = {}
    tokens: dict[str, list[int]] = {}
    ended: dict[str, FinishReason | None] = {}
    aborted_at: list[int] = []

    def on_output(rid: str) -> Callable[[Any], None]:
        def take(delta: Any) -> None:
            sample = delta.outputs[0] if delta.outputs else None
            tokens.setdefault(rid, []).extend(sample.token_ids if sample else ())
            if rid == "victim" and len(tokens[rid]) >= 5 and not done[rid].is_set():
                bigram_engine.abort("victim")  # on the loop thread, inside the step's outputs
                aborted_at.append(len(tokens[rid]))
                done[rid].set()  # an aborted request gets no further output
            if rid == "r0" and "late" not in done and len(tokens[rid]) >= 5:
                submit("late", late)
            if delta.finished:
                ended[rid] = sample.finish if sample else None
                done[rid].set()
        return take

    def submit(rid: str, prompt: list[int]) -> None:
        done[rid] = threading.Event()
        bigram_engine.submit_nowait(prompt, greedy(30), on_output(rid), request_id=rid)

    free = bigram_engine.stats.num_free_pages
    submit("victim", [2, 7, 1, 8])
    for i, p in enumerate(batch):
        submit(f"r{i}", p)
    for rid in ["victim", *(f"r{i}" for i in range(len(batch))), "late"]:
        assert rid in done and done[rid].wait(60), rid
    assert "victim" not in ended and aborted_at == [len(tokens["victim"])]
    assert tokens["victim"] == greedy_chain(probs, [2, 7, 1, 8], len(tokens["victim"]))
    for i, p in enumerate(batch):
        assert tokens[f"r{i}"] == greedy_chain(probs, p, 30)
        assert ended[f"r{i}"] is FinishReason.LENGTH
    assert tokens["late"] == greedy_chain(probs, late, 30)
    assert bigram_engine.stats.num_free_pages == free


def test_no_compile_after_warmup(bigram_engine: eSurge) -> None:
    jitted: tuple[Any, ...] = (model_step_features, verify_jit, store_draft_probs,
                               store_drafts, prompt_logprobs_step, proposer.propose_first,
                               proposer._propose_rest)
    before = [f._cache_size() for f in jitted]
    bigram_engine.generate(prompts(16, seed=4), [
        greedy(12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12),
        greedy(12, logprobs=2),
        SamplingParams(temperature=1.0, frequency_penalty=0.5, logit_bias={5: 1.0},
                       max_tokens=12, prompt_logprobs=1),
    ] * 4)
    assert [f._cache_size() for f in jitted] == before


@pytest.mark.parametrize(("options", "num_prompts"), [
    # 32 requests growing to 80-94 tokens (10-12 pages each) while up to 16 decode at
    # once in the 64-token budget; the cache has 159 pages: preemption.
    ({}, 32),
    ({"async_": True, "prefix": False}, 8),
], ids=["preemption", "async-flag-no-prefix-cache"])
def test_partial_acceptance_keeps_tokens(bigram_dirs: tuple[Path, Path], probs: np.ndarray,
                                         options: dict[str, object], num_prompts: int) -> None:
    target, _ = bigram_pair(bigram_dirs[0].parent, perturb=0.35)
    head = target.parent / "bigram_head_0.35"
    # The shared engine's shapes: every program is already compiled.
    config = spec_config(BIGRAM_K, head, max_num_seqs=32, batched_tokens=64,
                         **options)  # type: ignore[arg-type]
    rng = np.random.default_rng(21)
    batch = [rng.integers(0, VOCAB, size=int(n)).tolist()
             for n in np.linspace(20, 34, num_prompts)]
    with eSurge(target, config, show_progress=False, warmup=False, min_token_bucket=32,
                speculation="always") as llm:
        outs = llm.generate(batch, greedy(60))
        stats, preemptions = llm.runner.spec_stats, llm.scheduler.num_preemptions
        assert llm.runner.config.scheduler_config.async_scheduling is bool(options.get("async_"))
        # Every step drafts. With async scheduling a step of decoding requests
        # hands its drafts to the next at dispatch, which is scheduled and
        # dispatched before it is read (positions moved on the device); the
        # others (prompt chunks join) are collected first.
        core = llm.loop.core
        ahead, overlapped = core.num_drafts_ahead, core.num_overlapped_steps
    assert (ahead > 10 and overlapped >= ahead) is bool(options.get("async_"))
    assert [o.outputs[0].token_ids for o in outs] == [greedy_chain(probs, p, 60) for p in batch]
    assert stats is not None and 0.2 < stats.acceptance_rate < 0.95
    if not options:
        assert preemptions > 0


def test_seeded_samples_draw_the_same_tokens_when_steps_hand_drafts_ahead(
        bigram_dirs: tuple[Path, Path]) -> None:
    # Draws are keyed by (seed, output position): a step scheduled before the one
    # in flight is read must sample at the positions the device moved it to.
    target, _ = bigram_pair(bigram_dirs[0].parent, perturb=0.35)
    head = target.parent / "bigram_head_0.35"
    rng = np.random.default_rng(8)
    batch = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in np.linspace(20, 30, 6)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i, max_tokens=40,
                             ignore_eos=True) for i in range(len(batch))]
    tokens, ahead = {}, {}
    for async_ in (False, True):
        config = spec_config(BIGRAM_K, head, max_num_seqs=32, batched_tokens=64,
                             async_=async_, prefix=False)
        with eSurge(target, config, show_progress=False, warmup=False, min_token_bucket=32,
                    speculation="always") as llm:
            tokens[async_] = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
            ahead[async_], stats = llm.loop.core.num_drafts_ahead, llm.runner.spec_stats
        assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert tokens[True] == tokens[False]
    assert ahead[True] > 10 and ahead[False] == 0


def test_speculation_off_costs_nothing(bigram_dirs: tuple[Path, Path], probs: np.ndarray) -> None:
    jitted: tuple[Any, ...] = (model_step_features, verify_jit, proposer.propose_first,
                               proposer._propose_rest)
    before = [f._cache_size() for f in jitted]
    with eSurge(bigram_dirs[0], spec_config(None, None), show_progress=False,
                warmup=False) as llm:
        assert llm.runner.spec is None and llm.runner.spec_stats is None
        out = llm.generate([[1, 2, 3]], greedy(5))[0].outputs[0]
    assert out.token_ids == greedy_chain(probs, [1, 2, 3], 5)
    assert out.num_draft_tokens == out.num_accepted_tokens == 0
    # None of the speculative programs ran (or compiled).
    assert [f._cache_size() for f in jitted] == before


def test_missing_head_directory_is_refused(bigram_dirs: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        eSurge(bigram_dirs[0], spec_config(2, tmp_path / "nope"), show_progress=False,
               warmup=False)
