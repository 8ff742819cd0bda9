"""Deciding whether a request may enter the engine, and why not.

Turns the engine's InvalidRequestErrors into `google.rpc.BadRequest`
violations on the proto field the client set (`service.field_paths`), and
refuses work with RESOURCE_EXHAUSTED when too many requests already wait.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.rpc import status_pb2

from esurge.engine.inputs import Prompt
from esurge.engine.loop import EngineDeadError
from esurge.errors import InvalidRequestError
from generated.esurge.v1 import engine_pb2
from service.convert import GenerationRequest, engine_request_from_proto
from service.errors import (
    FieldViolation,
    InvalidFieldError,
    internal,
    invalid_argument,
    join_field_path,
    resource_exhausted,
)
from service.field_paths import engine_field_path
from service.info import MAX_N

if TYPE_CHECKING:
    from service.bridge import EngineBridge, Sink

__all__ = [
    "MAX_REQUEST_ID_CHARS",
    "REQUEST_ID_METADATA",
    "AdmissionPolicy",
    "check_request_id",
    "engine_error_violation",
    "metadata_request_id",
    "new_request_id",
    "parse_request",
    "submit_or_status",
]

# Metadata key a client (or a proxy) may set to choose the request id; the
# server echoes the id in effect under the same key in the initial metadata.
REQUEST_ID_METADATA = "x-request-id"
# The id is echoed in a header, so it must be a short, valid header value:
# printable ASCII without spaces.
MAX_REQUEST_ID_CHARS = 256

def new_request_id() -> str:
    """A server-assigned request id."""
    return f"srv-{uuid.uuid4().hex}"


def metadata_request_id(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The `x-request-id` value of a call's invocation metadata, if any."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA and value:
            return value.decode() if isinstance(value, bytes) else value
    return None


def _prompt_field(request: GenerationRequest) -> str:
    if request.chat is not None:
        return "chat"
    return "prompt_text" if request.prompt_text is not None else "prompt_token_ids"


def engine_error_violation(error: ValueError, request: GenerationRequest,
                           field_prefix: str) -> FieldViolation:
    """The violation behind an engine refusal, on the proto field the client set.

    `field_prefix` is the path of the EngineRequest inside the RPC message
    ("request" for Generate). An error that names no field is reported on
    the request as a whole.
    """
    message = str(error) or type(error).__name__
    field = (engine_field_path(error, _prompt_field(request))
             if isinstance(error, InvalidRequestError) else "")
    return FieldViolation(join_field_path(field_prefix, field), message)


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """When the server refuses new work for overload.

    max_queued_requests: requests may wait for a running slot until this many
    wait; one more is refused with RESOURCE_EXHAUSTED and a RetryInfo of
    retry_after_s seconds.
    """

    max_queued_requests: int = 1024
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_queued_requests, bool) or not isinstance(
                self.max_queued_requests, int) or self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be an int >= 0, "
                             f"got {self.max_queued_requests!r}")
        if not 0.0 <= self.retry_after_s < float("inf"):
            raise ValueError(f"retry_after_s must be a finite number >= 0, "
                             f"got {self.retry_after_s!r}")

    def refusal(self, bridge: EngineBridge) -> status_pb2.Status | None:
        """RESOURCE_EXHAUSTED when the waiting queue is full, else None."""
        # Requests still on their way into the scheduler will wait too.
        waiting = bridge.engine.stats.num_waiting + bridge.num_submitting
        if waiting < self.max_queued_requests:
            return None
        return resource_exhausted(
            f"{waiting} requests are already waiting (limit {self.max_queued_requests}); "
            f"retry later", self.retry_after_s)


def check_request_id(request_id: str, field: str, source: str = "request_id") -> None:
    """InvalidFieldError on `field` unless the id can be echoed in a header.

    `source` names where the id came from in the description (the metadata
    key when a client set it as metadata).
    """
    problem = None
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        problem = f"is {len(request_id)} characters long, more than {MAX_REQUEST_ID_CHARS}"
    elif not all("!" <= c <= "~" for c in request_id):
        problem = "must be printable ASCII without spaces"
    if problem is not None:
        raise InvalidFieldError([FieldViolation(field, f"{source} {problem}")])


def parse_request(msg: engine_pb2.EngineRequest, prefix: str) -> GenerationRequest:
    """Validate a proto EngineRequest; InvalidFieldError names each bad field."""
    check_request_id(msg.request_id, join_field_path(prefix, "request_id"))
    request = engine_request_from_proto(msg, field_prefix=prefix)
    n = request.sampling_params.n
    if n > MAX_N:
        raise InvalidFieldError([FieldViolation(
            f"{prefix}.sampling_params.n", f"n must be <= {MAX_N}, got {n}")])
    return request


async def submit_or_status(bridge: EngineBridge, request: GenerationRequest, request_id: str,
                           sink: Sink, prefix: str) -> status_pb2.Status | None:
    """Submit to the engine; None on success, else the `google.rpc.Status` refusing it."""
    prompt: Prompt = (request.chat if request.chat is not None
                      else request.prompt_token_ids if request.prompt_token_ids is not None
                      else request.prompt_text or "")
    try:
        await bridge.submit(request_id, prompt, request.sampling_params, sink,
                            priority=request.priority, cache_salt=request.cache_salt)
    except EngineDeadError as err:
        return internal(f"the engine is not running: {err}")
    except ValueError as err:
        return invalid_argument([engine_error_violation(err, request, prefix)])
    return None
