"""Refusals: each bad input is INVALID_ARGUMENT naming its field; overload is
RESOURCE_EXHAUSTED with a RetryInfo; a dead engine is INTERNAL. None of them
disturbs a request that is already running.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2, service_pb2
from service.client import AsyncEngineClient, EngineClient, build_request
from service.errors import field_violations, retry_delay_s, status_from_rpc_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def request(**sampling: Any) -> engine_pb2.EngineRequest:
    msg = build_request([5, 6, 7, 8])
    for name, value in sampling.items():
        if name == "logit_bias":
            msg.sampling_params.logit_bias.update(value)
        elif isinstance(value, list):
            getattr(msg.sampling_params, name).extend(value)
        else:
            setattr(msg.sampling_params, name, value)
    return msg


def no_prompt() -> engine_pb2.EngineRequest:
    return engine_pb2.EngineRequest()


def empty_ids() -> engine_pb2.EngineRequest:
    msg = engine_pb2.EngineRequest()
    msg.prompt_token_ids.SetInParent()
    return msg


def empty_text() -> engine_pb2.EngineRequest:
    msg = engine_pb2.EngineRequest()
    msg.prompt_text = ""
    return msg


def refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, list[str], Any]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    status = status_from_rpc_error(info.value)
    assert status is not None, info.value
    return info.value.code(), [v.field for v in field_violations(status)], status


BAD_REQUESTS: list[tuple[str, Callable[[], engine_pb2.EngineRequest], str]] = [
    ("no prompt", no_prompt, "request.prompt"),
    ("empty token ids", empty_ids, "request.prompt_token_ids"),
    ("empty text", empty_text, "request.prompt_text"),
    ("token id >= vocab", lambda: build_request([5, 512, 7]), "request.prompt_token_ids"),
    ("prompt + max_tokens > max_model_len", lambda: request(max_tokens=510),
     "request.sampling_params.max_tokens"),
    ("top_p > 1", lambda: request(top_p=1.5), "request.sampling_params.top_p"),
    ("negative temperature", lambda: request(temperature=-1.0),
     "request.sampling_params.temperature"),
    ("min_tokens > max_tokens", lambda: request(max_tokens=4, min_tokens=9),
     "request.sampling_params.min_tokens"),
    ("logprobs > 20", lambda: request(logprobs=21), "request.sampling_params.logprobs"),
    ("bias out of range", lambda: request(logit_bias={5: 300.0}),
     "request.sampling_params.logit_bias[5]"),
    ("bias token >= vocab", lambda: request(logit_bias={600: 1.0}),
     "request.sampling_params.logit_bias"),
    ("stop token >= vocab", lambda: request(stop_token_ids=[999]),
     "request.sampling_params.stop_token_ids"),
    ("max_tokens and unbounded", lambda: request(max_tokens=4, max_tokens_unbounded=True),
     "request.sampling_params.max_tokens_unbounded"),
    ("n above the server's limit", lambda: request(n=17), "request.sampling_params.n"),
]


@pytest.fixture
def running_stream(live_server: Any, client: EngineClient) -> Any:
    """A request generating in the background while bad ones are refused."""
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    [expected] = live_server.engine.generate([[40, 41, 42]], params)
    tokens: list[int] = []

    def generate() -> None:
        for message in client.generate([40, 41, 42], params, request_id="bystander"):
            tokens.extend(message.token_ids)

    thread = threading.Thread(target=generate)
    thread.start()
    yield
    thread.join(60)
    assert not thread.is_alive()
    assert tokens == expected.outputs[0].token_ids  # untouched by the refusals


def test_each_bad_input_names_its_field(client: EngineClient, running_stream: Any) -> None:
    for name, make, field in BAD_REQUESTS:
        code, fields, _ = refusal(functools.partial(client.generate_unary, make()))
        assert (name, code, fields) == (name, grpc.StatusCode.INVALID_ARGUMENT, [field])
    # The streaming call refuses the same way before sending anything.
    code, fields, _ = refusal(lambda: list(client.generate(request(top_p=0.0))))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["request.sampling_params.top_p"])


def test_duplicate_live_request_id(client: EngineClient) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = client.generate([21, 22], params, request_id="dup-1")
    next(stream)
    code, fields, _ = refusal(lambda: client.generate_unary([23], request_id="dup-1"))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["request.request_id"])
    # The id can come from x-request-id metadata too; it is checked the same way.
    code, fields, _ = refusal(lambda: client.generate_unary(
        [23], metadata=[("x-request-id", "dup-1")]))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["request.request_id"])
    assert client.abort(["dup-1"]) == ["dup-1"]
    assert list(stream)[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT
    # Once it has ended, the id is free again.
    assert client.generate_unary([23], SamplingParams(max_tokens=2), request_id="dup-1"
                                 ).request_id == "dup-1"


async def test_full_queue_is_resource_exhausted(live_server: Any, client: EngineClient) -> None:
    running = live_server.engine.config.scheduler_config.max_num_seqs
    total = running + live_server.max_queued_requests + 10
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    rejections: list[service_pb2.RequestRejection] = []
    async with AsyncEngineClient(live_server.target, timeout=120) as aclient:
        call = aclient.engine_stream()
        for i in range(total):
            await call.write(service_pb2.EngineStreamRequest(
                add_request=build_request([30 + i % 100, 31], params, request_id=f"q{i}")))
        async for response in call:
            if response.HasField("rejection"):
                rejections.append(response.rejection)
            if len(rejections) >= 10:
                break
        # While the queue is full, a plain call is refused too, with a retry delay.
        code, _, status = await asyncio.to_thread(
            refusal, lambda: client.generate_unary([50, 51]))
        call.cancel()  # closing the stream aborts all of its requests
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_delay_s(status) == 1.0
    assert {r.code for r in rejections} == {8}  # RESOURCE_EXHAUSTED
    assert all(r.request_id.startswith("q") for r in rejections)


def test_dead_engine_is_internal_and_not_serving(tiny_llama_dir: Path) -> None:
    from esurge.config import CacheConfig, Config, SchedulerConfig
    from esurge.engine.api import eSurge
    from service.server import create_server

    config = Config(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16,
                                    max_model_len=64, chunked_prefill_enabled=True),
                    CacheConfig(num_pages=16, page_size=8, enable_prefix_caching=False))
    engine = eSurge(tiny_llama_dir, config, warmup=False, show_progress=False)
    engine.shutdown()  # the engine loop is gone, as after a crash

    async def scenario() -> tuple[str, grpc.StatusCode]:
        server, port = await create_server(engine)
        try:
            async with AsyncEngineClient(f"127.0.0.1:{port}", timeout=10) as aclient:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await aclient.generate_unary([1, 2, 3])
                return await aclient.health(), info.value.code()
        finally:
            await server.stop(None)

    health, code = asyncio.run(scenario())
    assert (health, code) == ("NOT_SERVING", grpc.StatusCode.INTERNAL)


def long_prompt(length: int, **sampling: Any) -> engine_pb2.EngineRequest:
    msg = request(**sampling)
    msg.prompt_token_ids.token_ids[:] = [5 + i % 400 for i in range(length)]
    return msg


def text_prompt(text: str) -> engine_pb2.EngineRequest:
    msg = engine_pb2.EngineRequest(prompt_text=text)
    msg.sampling_params.max_tokens = 4
    return msg


# A prompt no max_tokens could make fit is the prompt's fault, not max_tokens'.
OVERLONG_PROMPTS: list[tuple[str, Callable[[], engine_pb2.EngineRequest], str]] = [
    ("600 ids, max_tokens unset", lambda: long_prompt(600), "request.prompt_token_ids"),
    ("600 ids, max_tokens 4", lambda: long_prompt(600, max_tokens=4),
     "request.prompt_token_ids"),
    ("512 ids, unbounded", lambda: long_prompt(512, max_tokens_unbounded=True),
     "request.prompt_token_ids"),
    ("1 MB of text", lambda: text_prompt("x" * (1 << 20)), "request.prompt_text"),
]


def test_overlong_prompt_names_the_prompt(client: EngineClient) -> None:
    for name, make, field in OVERLONG_PROMPTS:
        code, fields, _ = refusal(functools.partial(client.generate_unary, make()))
        assert (name, code, fields) == (name, grpc.StatusCode.INVALID_ARGUMENT, [field])


BAD_IDS = ["caf\u00e9", "line\nbreak", "x" * 20_000, "tab\there"]


def test_bad_request_id_is_invalid_argument(client: EngineClient) -> None:
    for bad in BAD_IDS:
        for call in (functools.partial(client.generate_unary, [5, 6], request_id=bad),
                     lambda bad=bad: list(client.generate([5, 6], request_id=bad))):
            code, fields, status = refusal(call)
            assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT,
                                      ["request.request_id"]), bad[:20]
    # From metadata the value is ASCII already; a long one is refused the same
    # way, and the description names the metadata key.
    code, fields, status = refusal(lambda: client.generate_unary(
        [5, 6], metadata=[("x-request-id", "y" * 1000)]))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["request.request_id"])
    assert "x-request-id" in field_violations(status)[0].description
    ok = "Req-42_a.b:c/d"
    assert client.generate_unary([5, 6], SamplingParams(max_tokens=2),
                                 request_id=ok).request_id == ok


def _raw_unary(client: EngineClient, method: str) -> Callable[[bytes], Any]:
    return client.channel.unary_unary(f"/esurge.v1.EngineService/{method}",
                                      request_serializer=None, response_deserializer=None)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _string_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field on the wire, whatever its payload."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_invalid_utf8_is_invalid_argument(client: EngineClient) -> None:
    bad = b"\xff\xfe"
    cases = [
        # GenerateUnaryRequest.request (1) -> EngineRequest.prompt_text (3)
        ("GenerateUnary", _string_field(1, _string_field(3, bad)), "request.prompt_text"),
        # ... -> EngineRequest.request_id (1)
        ("GenerateUnary", _string_field(1, _string_field(1, bad) + _string_field(3, b"hi")),
         "request.request_id"),
        # TokenizeRequest.text (1)
        ("Tokenize", _string_field(1, bad), "text"),
    ]
    for method, payload, field in cases:
        call = functools.partial(_raw_unary(client, method), payload, timeout=10)
        code, fields, _ = refusal(call)
        assert (method, code, fields) == (method, grpc.StatusCode.INVALID_ARGUMENT, [field])
    # The streaming call refuses the same way.
    stream = client.channel.unary_stream("/esurge.v1.EngineService/Generate",
                                         request_serializer=None, response_deserializer=None)
    code, fields, _ = refusal(lambda: list(stream(cases[0][1], timeout=10)))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["request.prompt_text"])


def test_invalid_utf8_on_an_engine_stream_is_a_rejection(client: EngineClient) -> None:
    good = service_pb2.EngineStreamRequest(add_request=build_request(
        [5, 6], SamplingParams(max_tokens=2), request_id="good-after-bad")).SerializeToString()
    bad = _string_field(1, _string_field(3, b"\xc3("))  # add_request.prompt_text
    stream = client.channel.stream_stream(
        "/esurge.v1.EngineService/EngineStream", request_serializer=None,
        response_deserializer=service_pb2.EngineStreamResponse.FromString)
    responses = list(stream(iter([bad, good]), timeout=30))
    rejection = responses[0].rejection
    assert rejection.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    status = status_pb2.Status(code=rejection.code, details=rejection.details)
    assert [v.field for v in field_violations(status)] == ["add_request.prompt_text"]
    finished = [o.request_id for r in responses[1:] for o in r.outputs.outputs
                if o.finish_reason]
    assert finished == ["good-after-bad"]


def test_unknown_sampling_field_is_refused(client: EngineClient) -> None:
    msg = build_request([5, 6, 7], SamplingParams(max_tokens=2))
    # A second sampling_params (4) on the wire merges into the first: it adds
    # varint field 127 = 1, which this server's SamplingParams does not have.
    engine_request = msg.SerializeToString() + _string_field(4, _varint(127 << 3) + b"\x01")
    parsed = engine_pb2.EngineRequest.FromString(engine_request)
    assert parsed.sampling_params.max_tokens == 2
    code, fields, status = refusal(lambda: _raw_unary(client, "GenerateUnary")(
        _string_field(1, engine_request), timeout=10))
    assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT, ["request.sampling_params"])
    assert "127" in field_violations(status)[0].description


def test_field_paths_do_not_depend_on_message_text(client: EngineClient,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from esurge.errors import FieldError

    original = FieldError.__init__

    def reworded(self: FieldError, field: str, message: str) -> None:
        original(self, field, "reworded: " + message[::-1])

    monkeypatch.setattr(FieldError, "__init__", reworded)
    descriptions: list[str] = []
    for name, make, field in BAD_REQUESTS + OVERLONG_PROMPTS:
        code, fields, status = refusal(functools.partial(client.generate_unary, make()))
        assert (name, code, fields) == (name, grpc.StatusCode.INVALID_ARGUMENT, [field])
        descriptions.extend(v.description for v in field_violations(status))
    # The engine's own refusals were reworded, and still named their fields.
    assert sum(d.startswith("reworded: ") for d in descriptions) >= 12


async def test_engine_stream_request_id_rules(live_server: Any, client: EngineClient) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    rejections: list[service_pb2.RequestRejection] = []
    outputs = 0
    async with AsyncEngineClient(live_server.target, timeout=120) as aclient:
        call = aclient.engine_stream()
        await call.write(service_pb2.EngineStreamRequest(add_request=build_request([5, 6])))
        await call.write(service_pb2.EngineStreamRequest(
            add_request=build_request([7, 8], long, request_id="es-dup")))
        sent_duplicate = closed = False
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.HasField("rejection"):
                rejections.append(response.rejection)
            elif not sent_duplicate:  # es-dup is running: send its id again
                sent_duplicate = True
                await call.write(service_pb2.EngineStreamRequest(add_request=build_request(
                    [9], SamplingParams(max_tokens=2), request_id="es-dup")))
            else:
                outputs += 1
            if len(rejections) == 2 and not closed:
                closed = True
                await call.write(service_pb2.EngineStreamRequest(
                    abort=service_pb2.RequestIds(request_ids=["es-dup"])))
                await call.done_writing()
    got = []
    for r in rejections:
        status = status_pb2.Status(code=r.code, details=r.details)
        got.append((r.request_id, r.code, [v.field for v in field_violations(status)]))
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert got == [("", invalid, ["add_request.request_id"]),
                   ("es-dup", invalid, ["add_request.request_id"])]
    assert outputs > 0


def test_a_refusal_echoing_a_long_value_still_reaches_the_client(client: EngineClient) -> None:
    """A refusal carries its message twice in trailers, which clients cap at 8 KiB by
    default. A stop list with an empty string and a 3,000-character one was
    refused with the whole list in the message: the client got RESOURCE_EXHAUSTED
    ("metadata size exceeds soft limit") instead of the refusal. Descriptions and
    messages are clipped, so it gets INVALID_ARGUMENT naming the field."""
    bad = request(stop=["", "x" * 3000], bad_words=["é" * 3000])
    for call in (lambda: client.generate_unary(bad), lambda: list(client.generate(bad))):
        code, fields, status = refusal(call)
        assert (code, fields) == (grpc.StatusCode.INVALID_ARGUMENT,
                                  ["request.sampling_params.stop"])
        description = field_violations(status)[0].description
        assert description.startswith("stop must be") and description.endswith("bytes, cut]")
        assert len(description.encode()) <= 240 and len(status.message.encode()) <= 600
