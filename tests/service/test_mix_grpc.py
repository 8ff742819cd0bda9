"""Over gRPC, each request of a concurrent mix gets what the library gives it alone.

The mixes of tests/engine/test_mix_fuzz.py (every sampling option esurge.v1
carries, shared prefixes, n, constraints, priorities) are sent to the shared real server all
at once, each from its own thread: every other request over a streaming
Generate, whose messages are added up, the rest over GenerateUnary. Each
answer must carry the tokens, text, finish and stop reasons, logprobs and
prompt logprobs that `eSurge.generate` returns for the request alone on the
server's own engine, and a usage that counts them. The same mixes multiplexed
over one EngineStream call (as a gateway sends them) must do the same.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import given, seed

from esurge.engine.request_output import CompletionOutput, RequestOutput
from esurge.engine_types import FinishReason
from esurge.outputs import TokenLogprobs
from generated.esurge.v1 import engine_pb2, service_pb2
from service.client import EngineClient, build_request
from service.responses import sample_request_id
from tests.engine.test_mix_fuzz import Mix, _same, fuzz_settings, mixes
from tests.service.conftest import LiveServer

EXAMPLES = int(os.environ.get("ESURGE_FUZZ_EXAMPLES", "30"))
# Prompts up to 159 tokens: three prefill chunks at the server's 64 tokens a step.
LONG = 200

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _logprobs(msg: engine_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(tuple(msg.token_ids), tuple(msg.logprobs), msg.rank)


def _prompt_logprobs(entries: Any) -> list[TokenLogprobs | None] | None:
    out = [_logprobs(e.logprobs) if e.HasField("logprobs") else None for e in entries]
    return out or None


def _finish(reason: int) -> FinishReason | None:
    name = engine_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_")
    return None if name == "UNSPECIFIED" else FinishReason[name]


def _stop_reason(msg: Any) -> int | str | None:
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)


def _completion(index: int, token_ids: list[int], text: str, logprobs: list[TokenLogprobs],
                msg: Any) -> CompletionOutput:
    return CompletionOutput(index, text, token_ids, _finish(msg.finish_reason),
                            _stop_reason(msg), logprobs or None)


Answer = tuple[RequestOutput, list[Any]]  # the output, and the usages that count it


def _unary(response: service_pb2.GenerateUnaryResponse) -> Answer:
    """One usage for the request: its samples' tokens summed."""
    samples = [_completion(c.index, list(c.token_ids), c.text,
                           [_logprobs(lp) for lp in c.logprobs], c)
               for c in sorted(response.completions, key=lambda c: c.index)]
    output = RequestOutput(response.request_id, None, [], samples, True,
                           prompt_logprobs=_prompt_logprobs(response.prompt_logprobs))
    return output, [response.usage]


def _streamed(messages: list[service_pb2.GenerateResponse]) -> Answer:
    """One usage per sample, on its last message."""
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    logprobs: dict[int, list[TokenLogprobs]] = {}
    last: dict[int, service_pb2.GenerateResponse] = {}
    prompt_logprobs: list[Any] = []
    usages: dict[int, Any] = {}
    for msg in messages:
        tokens.setdefault(msg.index, []).extend(msg.token_ids)
        texts[msg.index] = texts.get(msg.index, "") + msg.text
        logprobs.setdefault(msg.index, []).extend(_logprobs(lp) for lp in msg.logprobs)
        prompt_logprobs.extend(msg.prompt_logprobs)
        last[msg.index] = msg
        if msg.HasField("usage"):
            usages[msg.index] = msg.usage
    samples = [_completion(i, tokens[i], texts[i], logprobs[i], last[i]) for i in sorted(last)]
    output = RequestOutput(messages[0].request_id, None, [], samples, True,
                           prompt_logprobs=_prompt_logprobs(prompt_logprobs))
    return output, [usages[i] for i in sorted(usages)]


def _send(client: EngineClient, mix: Mix, i: int) -> Answer:
    options = {"priority": mix.priorities[i], "return_text": True}
    if i % 2:
        return _streamed(list(client.generate(mix.prompts[i], mix.params[i], **options)))
    return _unary(client.generate_unary(mix.prompts[i], mix.params[i], **options))


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@fuzz_settings(EXAMPLES)
@given(mix=mixes(max_len=LONG))
def test_a_mix_over_grpc_gives_each_request_what_it_gets_alone(live_server: LiveServer,
                                                              mix: Mix) -> None:
    mix = _strip_bad_words(mix)
    engine = live_server.engine
    alone = [engine.generate([p], params)[0]
             for p, params in zip(mix.prompts, mix.params, strict=True)]
    n = len(mix.prompts)
    with (EngineClient(live_server.target, timeout=60) as client,
          ThreadPoolExecutor(n) as pool):
        answers = list(pool.map(lambda i: _send(client, mix, i), range(n)))
    for i, (a, (got, usages)) in enumerate(zip(alone, answers, strict=True)):
        how = "Generate" if i % 2 else "GenerateUnary"
        difference = _same(a, got)
        assert difference is None, f"request {i} over {how}: {difference}"
        counts = [len(c.token_ids) for c in a.outputs]
        assert [u.completion_tokens for u in usages] == (counts if i % 2 else [sum(counts)])
        assert all(u.prompt_tokens == len(mix.prompts[i]) for u in usages), usages
    load = live_server.wait_idle()
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0), load


def _strip_bad_words(mix: Mix) -> Mix:
    # esurge.v1 has no token-id bad words (sampling_params_to_proto refuses them).
    return dataclasses.replace(mix, params=[dataclasses.replace(p, bad_words_token_ids=())
                                            for p in mix.params])


def _multiplexed(outputs: list[engine_pb2.EngineCoreOutputs], mix: Mix) -> list[RequestOutput]:
    """Each request's output, added up from the stream's per-step messages."""
    by_id: dict[str, list[engine_pb2.EngineCoreOutput]] = {}
    finished: list[str] = []
    for step in outputs:
        for out in step.outputs:
            by_id.setdefault(out.request_id, []).append(out)
        finished.extend(step.finished_requests)
    assert sorted(finished) == sorted(set(finished)), f"finished twice: {finished}"
    answers = []
    for i, params in enumerate(mix.params):
        prompt_logprobs: list[Any] = []
        samples = []
        for index in range(params.n):
            parts = by_id.pop(sample_request_id(f"mux-{i}", index, params.n))
            assert [p.finish_reason != 0 for p in parts].count(True) == 1, parts
            assert parts[-1].finish_reason != 0, parts
            for part in parts:
                prompt_logprobs.extend(part.new_prompt_logprobs)
            samples.append(_completion(
                index, [t for p in parts for t in p.new_token_ids], "",
                [_logprobs(lp) for p in parts for lp in p.new_logprobs], parts[-1]))
        answers.append(RequestOutput(f"mux-{i}", None, [], samples, True,
                                     prompt_logprobs=_prompt_logprobs(prompt_logprobs)))
    assert not by_id, f"outputs for requests never sent: {sorted(by_id)}"
    return answers


def assert_tokens_as_alone(alone: list[RequestOutput], answers: list[RequestOutput],
                           mix: Mix) -> None:
    """Each answer (of a protocol without text) is its request's output alone;
    an aborted one, a prefix of it."""
    for i, (a, got) in enumerate(zip(alone, answers, strict=True)):
        if any(s.finish == FinishReason.ABORT for s in got.outputs):
            # What came before the abort is where the request was heading.
            assert mix.aborts[i] is not None, f"request {i} aborted unasked"
            assert all(s.token_ids == a.outputs[s.index].token_ids[:len(s.token_ids)]
                       for s in got.outputs), f"request {i} (aborted)"
            continue
        a = dataclasses.replace(a, outputs=[dataclasses.replace(c, text="")
                                            for c in a.outputs])
        difference = _same(a, got)
        assert difference is None, f"request {i} ({'streamed' if i % 2 else 'whole'}): " \
                                   f"{difference}"


def _engine_stream(target: str, mix: Mix) -> list[service_pb2.EngineStreamResponse]:
    """Every request of the mix on one EngineStream; a request with an abort
    point is aborted on the stream once that many of its outputs arrived.
    The client half-closes when every request has ended."""
    actions: queue.SimpleQueue[service_pb2.EngineStreamRequest | None] = queue.SimpleQueue()
    for i, (prompt, params, priority) in enumerate(
            zip(mix.prompts, mix.params, mix.priorities, strict=True)):
        actions.put(service_pb2.EngineStreamRequest(add_request=build_request(
            prompt, params, request_id=f"mux-{i}", priority=priority, return_text=False)))

    def messages() -> Iterator[service_pb2.EngineStreamRequest]:
        while (action := actions.get(timeout=60)) is not None:
            yield action

    abort_after = {f"mux-{i}": k for i, k in enumerate(mix.aborts) if k is not None}
    request_of = {sample_request_id(f"mux-{i}", j, p.n): f"mux-{i}"
                  for i, p in enumerate(mix.params) for j in range(p.n)}
    open_samples = set(request_of)
    seen: collections.Counter[str] = collections.Counter()
    replies = []
    with EngineClient(target, timeout=60) as client:
        for reply in client.engine_stream(messages()):
            replies.append(reply)
            for out in reply.outputs.outputs:
                rid = request_of[out.request_id]
                seen[rid] += 1
                if seen[rid] == abort_after.get(rid):
                    actions.put(service_pb2.EngineStreamRequest(
                        abort=service_pb2.RequestIds(request_ids=[rid])))
            open_samples -= set(reply.outputs.finished_requests)
            if not open_samples:
                actions.put(None)
    return replies


@seed(int(os.environ.get("ESURGE_FUZZ_SEED", "0")))
@fuzz_settings(EXAMPLES)
@given(mix=mixes(max_len=LONG))
def test_a_mix_over_one_engine_stream_gives_each_request_what_it_gets_alone(
        live_server: LiveServer, mix: Mix) -> None:
    mix = _strip_bad_words(mix)
    engine = live_server.engine
    alone = [engine.generate([p], params)[0]
             for p, params in zip(mix.prompts, mix.params, strict=True)]
    replies = _engine_stream(live_server.target, mix)
    assert not [r for r in replies if r.HasField("rejection")], replies
    assert_tokens_as_alone(alone, _multiplexed([r.outputs for r in replies], mix), mix)
    load = live_server.wait_idle()
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0), load
    assert load.kv_cache_usage == 0.0, load
