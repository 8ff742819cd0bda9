"""Rich error statuses, decoded by a real client from a loopback grpc.aio server.

The servicer below is a test-only EngineService that refuses calls through the
helpers of service.errors; the assertions read the statuses the way any gRPC
client would (the `grpc-status-details-bin` trailer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from generated.esurge.v1 import engine_pb2, sampling_pb2, service_pb2, service_pb2_grpc
from service import convert, errors
from service.errors import FieldViolation, InvalidFieldError

pytestmark = pytest.mark.timeout(60)


class RefusingServicer(service_pb2_grpc.EngineServiceServicer):
    """Validates with service.convert and refuses through service.errors."""

    async def GenerateUnary(self, request: Any, context: Any) -> Any:
        try:
            parsed = convert.engine_request_from_proto(request.request, field_prefix="request")
        except InvalidFieldError as err:
            await errors.abort_with_status(context, errors.invalid_argument(err.violations))
        return service_pb2.GenerateUnaryResponse(request_id=parsed.request_id or "assigned")

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield service_pb2.GenerateResponse(request_id="r-1", token_ids=[1])
        await errors.abort_with_status(
            context, errors.resource_exhausted("too many waiting requests", retry_after_s=1.5))

    async def Tokenize(self, request: Any, context: Any) -> Any:
        await errors.abort_with_status(context, errors.unavailable("server is draining"))

    async def Detokenize(self, request: Any, context: Any) -> Any:
        await errors.abort_with_status(context, errors.internal("engine step failed"))

    async def EngineStream(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        async for item in request_iterator:
            req = item.add_request
            try:
                convert.engine_request_from_proto(req, field_prefix="add_request")
            except InvalidFieldError as err:
                status = errors.invalid_argument(err.violations)
                yield service_pb2.EngineStreamResponse(
                    rejection=errors.rejection_from_status(req.request_id, status))
                continue
            out = engine_pb2.EngineCoreOutput(request_id=req.request_id, new_token_ids=[7])
            yield service_pb2.EngineStreamResponse(
                outputs=engine_pb2.EngineCoreOutputs(outputs=[out]))


@pytest.fixture
async def stub() -> AsyncIterator[Any]:
    server = grpc.aio.server()
    service_pb2_grpc.add_EngineServiceServicer_to_server(RefusingServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield service_pb2_grpc.EngineServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=None)


def _generate(**sampling: Any) -> service_pb2.GenerateUnaryRequest:
    return service_pb2.GenerateUnaryRequest(request=engine_pb2.EngineRequest(
        prompt_token_ids=engine_pb2.TokenIds(token_ids=[1, 2]),
        sampling_params=sampling_pb2.SamplingParams(**sampling)))


async def _rich_status(call: Any) -> tuple[grpc.aio.AioRpcError, status_pb2.Status]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    status = errors.status_from_rpc_error(info.value)
    assert status is not None
    return info.value, status


async def test_valid_request_passes(stub: Any) -> None:
    response = await stub.GenerateUnary(_generate(top_p=0.5))
    assert response.request_id == "assigned"


async def test_bad_top_p_is_invalid_argument_naming_the_field(stub: Any) -> None:
    err, status = await _rich_status(stub.GenerateUnary(_generate(top_p=1.5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert status.code == code_pb2.INVALID_ARGUMENT
    assert errors.field_violations(status) == (FieldViolation(
        "request.sampling_params.top_p", "top_p must be in (0, 1], got 1.5"),)
    assert err.details() == "request.sampling_params.top_p: top_p must be in (0, 1], got 1.5"


async def test_every_violation_reaches_the_client(stub: Any) -> None:
    request = service_pb2.GenerateUnaryRequest(request=engine_pb2.EngineRequest(
        prompt_text="", sampling_params=sampling_pb2.SamplingParams(logit_bias={9: -101.0})))
    _, status = await _rich_status(stub.GenerateUnary(request))
    assert [v.field for v in errors.field_violations(status)] == [
        "request.prompt_text", "request.sampling_params.logit_bias[9]"]


async def test_overload_mid_stream_carries_retry_info(stub: Any) -> None:
    call = stub.Generate(service_pb2.GenerateRequest())
    first = await call.read()
    assert list(first.token_ids) == [1]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = errors.status_from_rpc_error(info.value)
    assert status is not None and status.message == "too many waiting requests"
    assert errors.retry_delay_s(status) == 1.5


async def test_draining_is_unavailable_with_reason(stub: Any) -> None:
    err, status = await _rich_status(stub.Tokenize(service_pb2.TokenizeRequest(text="x")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert errors.retry_delay_s(status) is None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("DRAINING", "esurge.v1")


async def test_internal_failure(stub: Any) -> None:
    err, status = await _rich_status(stub.Detokenize(service_pb2.DetokenizeRequest()))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == "engine step failed"
    assert errors.field_violations(status) == ()


async def test_stream_rejection_keeps_the_stream_running(stub: Any) -> None:
    def requests() -> Iterator[service_pb2.EngineStreamRequest]:
        bad = engine_pb2.EngineRequest(request_id="bad", prompt_token_ids=engine_pb2.TokenIds(
            token_ids=[1]), sampling_params=sampling_pb2.SamplingParams(n=0))
        good = engine_pb2.EngineRequest(request_id="good", prompt_text="hi")
        yield service_pb2.EngineStreamRequest(add_request=bad)
        yield service_pb2.EngineStreamRequest(add_request=good)

    responses = [r async for r in stub.EngineStream(requests())]
    assert [r.WhichOneof("payload") for r in responses] == ["rejection", "outputs"]
    rejection = responses[0].rejection
    assert (rejection.request_id, rejection.code) == ("bad", code_pb2.INVALID_ARGUMENT)
    status = status_pb2.Status(code=rejection.code, message=rejection.message,
                               details=rejection.details)
    assert [v.field for v in errors.field_violations(status)] == ["add_request.sampling_params.n"]
    assert responses[1].outputs.outputs[0].request_id == "good"


def test_helpers_refuse_misuse() -> None:
    with pytest.raises(ValueError, match="retry_after_s"):
        errors.resource_exhausted("busy", retry_after_s=-1.0)
    with pytest.raises(ValueError, match="at least one"):
        errors.invalid_argument([])
    with pytest.raises(ValueError, match="at least one"):
        InvalidFieldError([])
    with pytest.raises(ValueError, match="code OK"):
        errors.to_grpc_status(status_pb2.Status(code=code_pb2.OK))


def test_grpc_status_carries_the_serialized_details() -> None:
    status = errors.invalid_argument([FieldViolation("prompt", "must be set")], message="bad")
    grpc_status = errors.to_grpc_status(status)
    assert grpc_status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_status.details == "bad"
    [(key, value)] = grpc_status.trailing_metadata
    assert key == "grpc-status-details-bin"
    assert status_pb2.Status.FromString(value) == status
