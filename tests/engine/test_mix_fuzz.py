"""A request's output does not depend on the company it keeps.

Hypothesis draws mixes of 2-8 requests: prompts that share prefixes, and
sampling options of every kind (seeded temperatures, top-k/p, min-p, the three
penalties, logit bias, allow-lists, bad words, min_tokens, stop tokens and
strings, logprobs, prompt logprobs, n, regex and choice constraints) and
priorities. Each request runs alone on the roomy synchronous engine; then the
whole mix runs at once on a tight one: async and priority scheduling, decode
bursts of 4, chunked prefill with an 8-token threshold and 23 usable pages,
so requests are chunked, preempted and resumed, share cached pages and ride
in bursts; every other request streams and its deltas are added up. Every
sample must come out the same: tokens, text, finish and stop reasons,
logprobs and prompt logprobs. Afterwards every page of the tight engine is
free. The same runs on a tiny Gemma 3, whose sliding-window pages leave the
window while its full-attention ones are cached.

Examples are derandomized and requests seeded, so a failure replays;
ESURGE_FUZZ_EXAMPLES and ESURGE_FUZZ_SEED run a longer hunt.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from esurge import SamplingParams, StructuredOutputsParams, eSurge
from esurge.config import Config
from esurge.engine.request_output import CompletionOutput, RequestDelta, RequestOutput
from esurge.outputs import TokenLogprobs
from tests.engine.conftest import MAX_MODEL_LEN, engine_config
from tests.models.checkpoints import COMMON, build_model, hf_config, save_checkpoint

VOCAB = 512  # the tiny Llama's, with a tokenizer
CHECKPOINT_VOCAB = COMMON["vocab_size"]  # tests/models/checkpoints.py's, no tokenizer
EOS = 2
EXAMPLES = int(os.environ.get("ESURGE_FUZZ_EXAMPLES", "60"))
LOGPROB_TOLERANCE = 1e-4  # the same float32 math in other batch shapes
CUT_SHORT: Counter[eSurge] = Counter()  # streams aborted before they finished, per engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def tight_config() -> Config:
    """Async, priority scheduling, 23 usable pages of 8 tokens: a mix preempts."""
    config = engine_config(async_=True, num_pages=24, threshold=8)
    return dataclasses.replace(config, scheduler_config=dataclasses.replace(
        config.scheduler_config, policy="priority"))


@pytest.fixture(scope="session")
def tight(tiny_llama_dir: Path) -> Iterator[eSurge]:
    """The tiny Llama on tight_config(), in decode bursts of 4."""
    with eSurge(tiny_llama_dir, tight_config(), show_progress=False, decode_steps=4) as llm:
        yield llm


@st.composite
def sampling(draw: st.DrawFn, prompt_len: int, vocab: int = VOCAB, text: bool = True,
             max_len: int = MAX_MODEL_LEN) -> SamplingParams:
    """Options of every kind, each in a third or so of the requests (those that
    need a tokenizer only with `text`)."""
    ids = st.integers(3, vocab - 1)

    def maybe(strategy: st.SearchStrategy[Any], default: Any) -> Any:
        return draw(st.one_of(st.just(default), strategy))

    max_tokens = draw(st.integers(1, min(40, max_len - prompt_len)))
    allowed = maybe(st.lists(ids | st.just(EOS), min_size=2, max_size=6, unique=True), None)
    kwargs: dict[str, Any] = {
        "n": maybe(st.integers(2, 3), 1),
        "temperature": draw(st.sampled_from([0.0, 0.7, 1.0, 1.3])),
        "seed": draw(st.integers(0, 2 ** 32)),
        "top_k": maybe(st.sampled_from([1, 5, 40]), None),
        "top_p": maybe(st.sampled_from([0.3, 0.9]), 1.0),
        "min_p": maybe(st.sampled_from([0.05, 0.2]), 0.0),
        "presence_penalty": maybe(st.sampled_from([-0.5, 1.0]), 0.0),
        "frequency_penalty": maybe(st.sampled_from([-0.5, 1.5]), 0.0),
        "repetition_penalty": maybe(st.sampled_from([0.8, 1.3]), 1.0),
        "logit_bias": maybe(st.dictionaries(ids, st.sampled_from([-5.0, 3.0]), max_size=3),
                            None),
        "allowed_token_ids": allowed,
        "max_tokens": max_tokens,
        "min_tokens": maybe(st.integers(0, max_tokens), 0),
        "ignore_eos": draw(st.booleans()),
        "stop_token_ids": maybe(st.lists(ids, max_size=3), ()),
        "stop": maybe(st.lists(st.sampled_from(["a", "e", " t", "\n"]), max_size=2), ())
        if text else (),
        "include_stop_str_in_output": draw(st.booleans()),
        "logprobs": maybe(st.sampled_from([0, 1, 3]), None),
        "prompt_logprobs": maybe(st.sampled_from([0, 2]), None),
    }
    if allowed is not None and kwargs["min_tokens"]:
        kwargs["ignore_eos"] = True  # admission refuses an allow-list min_tokens empties
        kwargs["stop_token_ids"] = ()
    if text and allowed is None and draw(st.integers(0, 5)) == 0:
        kwargs["ignore_eos"] = False  # the output ends where the grammar does
        kwargs["structured_outputs"] = StructuredOutputsParams(**draw(st.sampled_from(
            [{"regex": "[a-z ]{1,12}"}, {"choice": ["yes", "no", "maybe so"]}])))
    params = SamplingParams(**kwargs)
    words = maybe(st.lists(st.lists(ids, min_size=1, max_size=2).map(tuple), max_size=2), [])
    return params.with_bad_words_token_ids(tuple(words)) if words else params


@dataclasses.dataclass(frozen=True)
class Mix:
    prompts: list[list[int]]
    params: list[SamplingParams]
    priorities: list[int]
    aborts: list[int | None]  # a streamed request is aborted after this many deltas


@st.composite
def mixes(draw: st.DrawFn, vocab: int = VOCAB, text: bool = True,
          max_len: int = MAX_MODEL_LEN) -> Mix:
    """2-8 requests; about half extend the prompt of an earlier one (prefix hits).
    Prompts of 1-40 new tokens, and with a `max_len` well past that, a quarter
    of max_len - 81 to max_len - 41 (several prefill chunks on an engine of
    larger steps)."""
    ids = st.integers(3, vocab - 1)
    sizes = st.just((1, 40))
    if max_len - 41 > 40:
        sizes = st.sampled_from([(1, 40)] * 3 + [(max_len - 81, max_len - 41)])
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(2, 8))):
        low, high = draw(sizes)
        tail = draw(st.lists(ids, min_size=low, max_size=high))
        if prompts and draw(st.booleans()):
            base = draw(st.sampled_from(prompts))
            tail = base[:draw(st.integers(1, len(base)))] + tail
        prompts.append(tail[:max_len - 1])
    n = len(prompts)
    return Mix(prompts, [draw(sampling(len(p), vocab, text, max_len)) for p in prompts],
               draw(st.lists(st.integers(-1, 1), min_size=n, max_size=n)),
               [draw(st.one_of(st.none(), st.integers(1, 6))) if i % 2 else None
                for i in range(n)])


def greedy(mix: Mix) -> Mix:
    """The mix with every request greedy (its other options kept)."""
    return dataclasses.replace(mix, params=[dataclasses.replace(p, temperature=0.0)
                                            for p in mix.params])


def _differ(a: Sequence[TokenLogprobs | None] | None,
            b: Sequence[TokenLogprobs | None] | None) -> str | None:
    """Where two logprob lists differ (ids exactly, values within tolerance), or None."""
    if a is None or b is None or len(a) != len(b):
        return None if a is b else f"{a!r} != {b!r}"
    for at, (x, y) in enumerate(zip(a, b, strict=True)):
        same = (x is None and y is None) or (
            x is not None and y is not None and x.token_ids[0] == y.token_ids[0]
            and len(x.token_ids) == len(y.token_ids)
            and all(math.isclose(p, q, abs_tol=LOGPROB_TOLERANCE)
                    for p, q in zip(x.logprobs, y.logprobs, strict=True)))
        if not same:
            return f"position {at}: {x} != {y}"
    return None


def _same(alone: RequestOutput, mixed: RequestOutput) -> str | None:
    """What differs between the two outputs of one request, or None."""
    if (where := _differ(alone.prompt_logprobs, mixed.prompt_logprobs)) is not None:
        return f"prompt_logprobs {where}"
    for a, m in zip(alone.outputs, mixed.outputs, strict=True):
        for name in ("token_ids", "text", "finish", "stop_reason"):
            if getattr(a, name) != getattr(m, name):
                return f"sample {a.index} {name}: {getattr(a, name)!r} != {getattr(m, name)!r}"
        if (where := _differ(a.logprobs, m.logprobs)) is not None:
            return f"sample {a.index} logprobs {where}"
    return None


def _assemble(prompt_ids: list[int], deltas: list[RequestDelta]) -> RequestOutput:
    """The RequestOutput a stream's deltas add up to."""
    samples: dict[int, CompletionOutput] = {}
    prompt_logprobs: list[TokenLogprobs | None] = []
    for delta in deltas:
        prompt_logprobs.extend(delta.prompt_logprobs)
        for part in delta.outputs:
            sample = samples.setdefault(part.index, CompletionOutput(part.index, logprobs=[]))
            sample.token_ids.extend(part.token_ids)
            sample.text += part.text
            assert sample.logprobs is not None
            sample.logprobs.extend(part.logprobs)
            sample.finish, sample.stop_reason = part.finish, part.stop_reason
    for sample in samples.values():
        sample.logprobs = sample.logprobs or None
    return RequestOutput(deltas[0].request_id, None, prompt_ids,
                         [samples[i] for i in sorted(samples)], finished=deltas[-1].finished,
                         prompt_logprobs=prompt_logprobs or None)


def _run_mix(tight: eSurge, mix: Mix) -> list[RequestOutput]:
    """The whole mix at once. Every other request streams and its deltas are added
    up; some streams are aborted after a few deltas (their outputs unfinished)."""
    events: queue.SimpleQueue[str] = queue.SimpleQueue()
    finals: dict[str, RequestOutput] = {}
    streams: dict[str, list[RequestDelta]] = {}

    def on_output(item: RequestOutput | RequestDelta) -> None:
        if isinstance(item, RequestOutput):
            finals[item.request_id] = item
        else:
            streams.setdefault(item.request_id, []).append(item)
        events.put(item.request_id)

    ids = [tight.submit_nowait(prompt, params, on_output, final_only=i % 2 == 0,
                               priority=priority)[0]
           for i, (prompt, params, priority) in enumerate(
               zip(mix.prompts, mix.params, mix.priorities, strict=True))]
    abort_after = {rid: k for rid, k in zip(ids, mix.aborts, strict=True) if k is not None}
    open_ids = set(ids)
    while open_ids:
        rid = events.get(timeout=120)
        seen = streams.get(rid, [])
        if rid in finals or (seen and seen[-1].finished):
            open_ids.discard(rid)
        elif rid in open_ids and len(seen) >= abort_after.get(rid, len(seen) + 1):
            tight.abort(rid)  # deltas already on their way may still arrive
            open_ids.discard(rid)
    _wait_idle(tight)
    return [finals[rid] if rid in finals else _assemble(prompt, streams[rid])
            for rid, prompt in zip(ids, mix.prompts, strict=True)]


def _wait_idle(llm: eSurge, timeout: float = 30.0) -> None:
    """Until nothing runs or waits and every page is free (aborts end without an output)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats
        if ((stats.num_running, stats.num_waiting) == (0, 0)
                and stats.num_free_pages == stats.num_usable_pages):
            return
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {stats}"
        time.sleep(0.01)


def _check_mix(reference: eSurge, tight: eSurge, mix: Mix) -> None:
    alone = [reference.generate([p], params)[0]
             for p, params in zip(mix.prompts, mix.params, strict=True)]
    mixed = _run_mix(tight, mix)
    for i, (a, m) in enumerate(zip(alone, mixed, strict=True)):
        if mix.aborts[i] is not None and not m.finished:
            # Aborted: what came before the abort is where the request was heading.
            assert all(s.token_ids == a.outputs[s.index].token_ids[:len(s.token_ids)]
                       for s in m.outputs), f"request {i} (aborted)"
            CUT_SHORT[tight] += 1
            continue
        difference = _same(a, m)
        assert difference is None, f"request {i} ({'streamed' if i % 2 else 'final'}): {difference}"


def fuzz_settings(examples: int) -> Any:
    """Derandomized unless ESURGE_FUZZ_SEED asks for other examples."""
    return settings(max_examples=examples, deadline=None,
                    derandomize="ESURGE_FUZZ_SEED" not in os.environ,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@fuzz_settings(EXAMPLES)
@given(mix=mixes())
def test_a_mix_gives_each_request_what_it_gets_alone(engine: eSurge, tight: eSurge,
                                                    mix: Mix) -> None:
    _check_mix(engine, tight, mix)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[eSurge, eSurge]]:
    """(reference, tight) engines over a tiny Gemma 3: a sliding-window group of
    8 tokens beside a full one, so pages leave the window while others are cached."""
    model = build_model(hf_config("gemma3"), seed=1)
    path = save_checkpoint(model, tmp_path_factory.mktemp("gemma3"))
    with (eSurge(path, engine_config(), show_progress=False) as reference,
          eSurge(path, tight_config(), show_progress=False, decode_steps=4) as tight):
        yield reference, tight


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@fuzz_settings(max(1, EXAMPLES // 2))
@given(mix=mixes(vocab=CHECKPOINT_VOCAB, text=False))
def test_a_windowed_mix_gives_each_request_what_it_gets_alone(
        windowed: tuple[eSurge, eSurge], mix: Mix) -> None:
    _check_mix(*windowed, mix)


def test_the_mixes_preempt_and_share_pages(tight: eSurge,
                                           windowed: tuple[eSurge, eSurge]) -> None:
    """The fuzzes above ran under the pressure they claim (run after them in file order)."""
    for llm in (tight, windowed[1]):
        assert llm.stats.num_preemptions > 0
        assert llm.stats.prefix_cache_hits > 0
        assert CUT_SHORT[llm] > 0


def test_token_state_counts_the_step_in_flight(engine: eSurge, tight: eSurge) -> None:
    """Under async scheduling the penalties, min_tokens and bad words saw every token
    but the previous step's (still on the device): the penalized request repeated
    72 ([72, 72, 203, 72, 72]) and EOS stayed banned a step past min_tokens."""
    prompt = [351, 100, 29]
    cases = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, presence_penalty=1.0,
                       frequency_penalty=-0.5, repetition_penalty=0.8),
        SamplingParams(temperature=0, max_tokens=6, min_tokens=2, allowed_token_ids=[10, EOS],
                       logit_bias={EOS: 50.0}),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[10, 11],
                       logit_bias={10: 50.0}).with_bad_words_token_ids(((10, 10),)),
    ]
    expected = [[72, 203, 166, 369, 232], [10, 10, EOS], [10, 11, 10, 11, 10, 11]]
    for params, tokens in zip(cases, expected, strict=True):
        for llm in (engine, tight):
            assert llm.generate([prompt], params)[0].outputs[0].token_ids == tokens


def test_a_preempted_request_reports_its_prompt_logprobs_once(engine: eSurge,
                                                              tight: eSurge) -> None:
    """Recomputing a preempted prompt reported its logprobs again (up to 7 copies)."""
    prompts = [[3 + (7 * i + j) % 500 for j in range(40)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    before = tight.stats.num_preemptions
    mixed = tight.generate(prompts, params)
    assert tight.stats.num_preemptions > before
    for prompt, out in zip(prompts, mixed, strict=True):
        [alone] = engine.generate([prompt], params)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert _differ(alone.prompt_logprobs, out.prompt_logprobs) is None
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
