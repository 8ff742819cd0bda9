"""Generation over gRPC gives exactly what the in-process engine gives.

A real server on a loopback port (tests/service/conftest.py), the real tiny
Llama, the real blocking and asyncio clients.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2, service_pb2
from service.client import AsyncEngineClient, build_request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LENGTH = engine_pb2.FINISH_REASON_LENGTH
ABORT = engine_pb2.FINISH_REASON_ABORT


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def prompt_ids(i: int) -> list[int]:
    """A distinct token-id prompt of 5 to 21 tokens."""
    return [3 + (i * 37 + j * 11) % 500 for j in range(5 + (i * 7) % 17)]


def test_stream_equals_engine_generate(live_server: Any, client: Any) -> None:
    prompt = "def fibonacci(n):\n    return"
    params = greedy(24)
    [expected] = live_server.engine.generate([prompt], params)
    stream = client.generate(prompt, params, metadata=[("x-request-id", "stream-eq-1")])
    messages = list(stream)

    assert dict(stream.initial_metadata())["x-request-id"] == "stream-eq-1"
    assert {m.request_id for m in messages} == {"stream-eq-1"}
    first, last = messages[0], messages[-1]
    assert first.HasField("prompt_info")
    assert first.prompt_info.num_prompt_tokens == len(expected.prompt_token_ids)
    assert not any(m.HasField("prompt_info") for m in messages[1:])
    assert [t for m in messages for t in m.token_ids] == expected.outputs[0].token_ids
    assert "".join(m.text for m in messages) == expected.outputs[0].text
    assert [m.finish_reason for m in messages[:-1]] == [0] * (len(messages) - 1)
    assert last.finish_reason == LENGTH
    assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert last.usage.completion_tokens == 24
    assert not any(m.HasField("usage") for m in messages[:-1])


def test_stream_token_id_prompt_with_logprobs(live_server: Any, client: Any) -> None:
    prompt = prompt_ids(1)
    params = greedy(10, logprobs=3)
    [expected] = live_server.engine.generate([prompt], params)
    messages = list(client.generate(prompt, params, return_prompt_token_ids=True))
    tokens = [t for m in messages for t in m.token_ids]
    logprobs = [lp for m in messages for lp in m.logprobs]
    assert tokens == expected.outputs[0].token_ids
    assert list(messages[0].prompt_info.prompt_token_ids) == prompt
    assert [lp.token_ids[0] for lp in logprobs] == tokens
    assert all(len(lp.token_ids) == 4 and lp.rank == 1 for lp in logprobs)  # greedy: rank 1


def test_prompt_logprobs_of_a_prompt_prefilled_in_chunks(live_server: Any, client: Any) -> None:
    # 150 tokens at 64 a step: three prefill chunks, the first two without a
    # token. Each path sends every position once; GenerateUnary and
    # EngineStream dropped the middle chunk's 64 (86 of 150 arrived).
    prompt = [3 + (i * 7) % 500 for i in range(150)]
    params = greedy(3, prompt_logprobs=1)
    [expected] = live_server.engine.generate([prompt], params)
    assert expected.prompt_logprobs is not None and len(expected.prompt_logprobs) == 150
    want = [None if e is None else (list(e.token_ids), pytest.approx(e.logprobs, abs=1e-4))
            for e in expected.prompt_logprobs]

    def entries(positions: Any) -> list[Any]:
        return [(list(p.logprobs.token_ids), list(p.logprobs.logprobs))
                if p.HasField("logprobs") else None for p in positions]

    streamed = [p for m in client.generate(prompt, params) for p in m.prompt_logprobs]
    unary = client.generate_unary(prompt, params).prompt_logprobs
    multiplexed = [p for r in client.engine_stream([service_pb2.EngineStreamRequest(
        add_request=build_request(prompt, params, request_id="chunked-plp"))])
        for o in r.outputs.outputs for p in o.new_prompt_logprobs]
    for how, got in (("Generate", streamed), ("GenerateUnary", unary),
                     ("EngineStream", multiplexed)):
        assert entries(got) == want, how


async def test_32_concurrent_streams(live_server: Any, client: Any) -> None:
    prompts = [prompt_ids(i) for i in range(32)]
    params = [greedy(8 + i % 9) for i in range(32)]
    expected = await asyncio.to_thread(live_server.engine.generate, prompts, params)

    async def one(aclient: AsyncEngineClient, i: int) -> list[int]:
        tokens: list[int] = []
        async for message in aclient.generate(prompts[i], params[i], request_id=f"c32-{i}"):
            assert message.request_id == f"c32-{i}"
            tokens.extend(message.token_ids)
        return tokens

    async with AsyncEngineClient(live_server.target, timeout=120) as aclient:
        got = await asyncio.gather(*(one(aclient, i) for i in range(32)))
    assert got == [e.outputs[0].token_ids for e in expected]


def test_unary_equals_engine_generate(live_server: Any, client: Any) -> None:
    prompt = "import os\nimport sys\n"
    params = greedy(12)
    [expected] = live_server.engine.generate([prompt], params)
    response = client.generate_unary(prompt, params, request_id="unary-1")
    assert response.request_id == "unary-1"
    [completion] = response.completions
    assert list(completion.token_ids) == expected.outputs[0].token_ids
    assert completion.text == expected.outputs[0].text
    assert completion.finish_reason == LENGTH
    assert response.prompt_info.num_prompt_tokens == len(expected.prompt_token_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (
        len(expected.prompt_token_ids), 12)


def test_unary_two_samples_of_a_seeded_request(client: Any) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, n=2, seed=7)
    first = client.generate_unary(prompt_ids(3), params)
    again = client.generate_unary(prompt_ids(3), params)
    assert [c.index for c in first.completions] == [0, 1]
    assert [list(c.token_ids) for c in first.completions] == [
        list(c.token_ids) for c in again.completions]  # seeded: reproducible
    assert first.usage.completion_tokens == 12


def test_prefix_cache_hits_are_reported(client: Any) -> None:
    prompt = [7 + i for i in range(40)]  # 5 full pages of 8 tokens
    client.generate_unary(prompt, greedy(2))
    before = client.load()
    messages = list(client.generate(prompt, greedy(2)))
    after = client.load()
    cached = messages[0].prompt_info.num_cached_tokens
    assert cached >= 32 and cached % 8 == 0
    assert messages[-1].usage.cached_prompt_tokens == cached
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == cached
    assert 0.0 < after.prefix_cache_hit_rate <= 1.0


def _add(request_id: str, prompt: list[int], params: SamplingParams
         ) -> service_pb2.EngineStreamRequest:
    return service_pb2.EngineStreamRequest(
        add_request=build_request(prompt, params, request_id=request_id))


async def test_engine_stream_interleaves_requests(live_server: Any, client: Any) -> None:
    from service.errors import field_violations

    params = {"es-a": greedy(12), "es-b": greedy(20)}
    prompts = {"es-a": prompt_ids(5), "es-b": prompt_ids(6)}
    expected = live_server.engine.generate([prompts["es-a"], prompts["es-b"]],
                                           [params["es-a"], params["es-b"]])
    tokens: dict[str, list[int]] = {"es-a": [], "es-b": [], "es-d": []}
    finish: dict[str, int] = {}
    rejections = []
    shared_steps = 0
    aborted_d = False
    async with AsyncEngineClient(live_server.target, timeout=60) as aclient:
        call = aclient.engine_stream()
        await call.write(_add("es-a", prompts["es-a"], params["es-a"]))
        await call.write(_add("es-b", prompts["es-b"], params["es-b"]))
        # A sampled request beside the greedy ones; ignore_eos so that it ends by length.
        await call.write(_add("es-c", prompt_ids(7),
                              SamplingParams(top_p=0.5, max_tokens=4, ignore_eos=True)))
        bad = build_request(prompt_ids(7), request_id="es-bad")
        bad.sampling_params.top_p = 1.5
        await call.write(service_pb2.EngineStreamRequest(add_request=bad))
        await call.write(_add("es-d", prompt_ids(8), greedy(400)))
        async for response in call:
            if response.HasField("rejection"):
                rejections.append(response.rejection)
                continue
            ids = {o.request_id for o in response.outputs.outputs}
            shared_steps += {"es-a", "es-b"} <= ids
            for output in response.outputs.outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finish_reason:
                    finish[output.request_id] = output.finish_reason
                    assert output.request_id in response.outputs.finished_requests
            if "es-a" in finish and "es-b" in finish and not aborted_d:
                aborted_d = True
                await call.write(service_pb2.EngineStreamRequest(
                    abort=service_pb2.RequestIds(request_ids=["es-d"])))
                await call.done_writing()
    assert tokens["es-a"] == expected[0].outputs[0].token_ids
    assert tokens["es-b"] == expected[1].outputs[0].token_ids
    assert shared_steps >= 1  # one message carried both requests' outputs
    assert finish == {"es-a": LENGTH, "es-b": LENGTH, "es-c": LENGTH, "es-d": ABORT}
    assert len(tokens["es-c"]) == 4
    assert 0 < len(tokens["es-d"]) < 400
    [rejection] = rejections
    assert (rejection.request_id, rejection.code) == ("es-bad", 3)  # INVALID_ARGUMENT
    from google.rpc import status_pb2

    status = status_pb2.Status(code=rejection.code, message=rejection.message,
                               details=rejection.details)
    assert [v.field for v in field_violations(status)] == ["add_request.sampling_params.top_p"]


def test_stop_string_and_events(live_server: Any, client: Any) -> None:
    prompt = "def main():\n"
    [free] = live_server.engine.generate([prompt], greedy(24))
    text = free.outputs[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2)
                if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,))
    [expected] = live_server.engine.generate([prompt], params)
    response = client.generate_unary(prompt, params, return_events=True)
    [completion] = response.completions
    assert completion.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert completion.stop_string == stop
    assert completion.text == expected.outputs[0].text == text[:text.find(stop)]
    assert list(completion.token_ids) == expected.outputs[0].token_ids
    kinds = [e.type for e in completion.events]
    assert kinds == [engine_pb2.ENGINE_CORE_EVENT_TYPE_QUEUED,
                     engine_pb2.ENGINE_CORE_EVENT_TYPE_SCHEDULED]
    assert 0 < completion.events[0].timestamp <= completion.events[1].timestamp
