"""Requests as they come off the wire: undecodable bytes are bad input, not a crash.

grpc answers a request its deserializer cannot parse with UNKNOWN. The
EngineService is registered here instead, with deserializers that turn a
parse failure into an `Undecodable` value; the handler then answers
INVALID_ARGUMENT naming the field at fault (a string field with invalid
UTF-8 is found by walking the wire format against the message's
descriptor). On an EngineStream the bad message is rejected and the stream
goes on, like any other bad request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message, message_factory, unknown_fields
from google.protobuf.descriptor import FieldDescriptor
from google.rpc import code_pb2, status_pb2

from generated.esurge.v1 import service_pb2
from service.errors import FieldViolation, abort_with_status, invalid_argument, join_field_path

__all__ = ["Undecodable", "engine_service_handler", "oneof_conflict", "undecodable_status",
           "unknown_field_numbers"]

_SERVICE = service_pb2.DESCRIPTOR.services_by_name["EngineService"]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request message that did not parse; field is "" when none could be named."""

    field: str
    reason: str


def undecodable_status(bad: Undecodable) -> status_pb2.Status:
    """INVALID_ARGUMENT for a message that did not parse, naming its field if known."""
    if bad.field:
        return invalid_argument([FieldViolation(bad.field, bad.reason)])
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT,
                             message=f"the request message did not parse: {bad.reason}")


def unknown_field_numbers(msg: message.Message) -> list[int]:
    """Numbers of the fields `msg` carries that its schema here does not define."""
    found = unknown_fields.UnknownFieldSet(msg)
    return sorted({found[i].field_number for i in range(len(found))})


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, bytes | None]]:
    """(field number, payload of a length-delimited field or None) of each field
    on the wire; stops quietly at a truncated or group-encoded field."""
    pos = 0
    try:
        while pos < len(data):
            tag, pos = _varint(data, pos)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
                yield tag >> 3, None
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                yield tag >> 3, None
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                yield tag >> 3, data[pos:pos + length]
                pos += length
            else:
                return  # groups: not used by this API
    except IndexError:
        return


def bad_utf8_field(data: bytes, descriptor: Any, prefix: str = "") -> str | None:
    """The path of the first string field holding invalid UTF-8, or None.

    `descriptor` is the message's `google.protobuf.descriptor.Descriptor`.
    """
    for number, chunk in _fields(data):
        field = descriptor.fields_by_number.get(number)
        if field is None or chunk is None:
            continue
        path = join_field_path(prefix, field.name)
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = bad_utf8_field(chunk, field.message_type, path)
            if found is not None:
                return found
    return None


def oneof_conflict(data: bytes, descriptor: Any, prefix: str = "") -> str | None:
    """The path of a field sent beside another member of its oneof, or None.

    The parser keeps the last member and drops the others without a word;
    a request that sets two (two prompts, two output constraints) is
    ambiguous and must be refused instead.
    """
    if not any(f.containing_oneof is not None or f.type == FieldDescriptor.TYPE_MESSAGE
               for f in descriptor.fields):
        return None
    chosen: dict[str, str] = {}
    for number, chunk in _fields(data):
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        path = join_field_path(prefix, field.name)
        oneof = field.containing_oneof
        if oneof is not None and chosen.setdefault(oneof.name, field.name) != field.name:
            return path
        if field.type == FieldDescriptor.TYPE_MESSAGE and chunk is not None and (
                not field.is_repeated):
            found = oneof_conflict(chunk, field.message_type, path)
            if found is not None:
                return found
    return None


def _deserializer(cls: type[message.Message]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            parsed = cls.FromString(data)
        except message.DecodeError as err:
            field = bad_utf8_field(data, cls.DESCRIPTOR)
            return Undecodable(field or "", "invalid UTF-8 in a string field" if field
                               else str(err))
        conflict = oneof_conflict(data, cls.DESCRIPTOR)
        if conflict is not None:
            return Undecodable(conflict, f"{conflict.rsplit('.', 1)[-1]} was sent beside "
                                         "another field of the same oneof; set one only")
        return parsed
    return parse


def _unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def checked(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await abort_with_status(context, undecodable_status(request))
        return await behavior(request, context)
    return checked


def _server_streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    async def checked(request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await abort_with_status(context, undecodable_status(request))
        async for response in behavior(request, context):
            yield response
    return checked


def engine_service_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """The EngineService's handlers over `servicer`, with tolerant deserializers.

    A client-streaming method's behavior receives `Undecodable` items among
    its requests and must handle them itself.
    """
    handlers = {}
    for method in _SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        kwargs = {"request_deserializer": _deserializer(request_cls),
                  "response_serializer": response_cls.SerializeToString}
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(behavior, **kwargs)
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _server_streaming(behavior), **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(behavior), **kwargs)
    return grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers)
