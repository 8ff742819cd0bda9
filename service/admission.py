"""Deciding whether a request may enter the engine, and why not.

Turns the engine's ValueErrors (its messages start with what is wrong:
"prompt_token_ids [600] are outside ...", "top_p must be ...") into
`google.rpc.BadRequest` violations on the proto field the client set, and
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
from esurge.errors import InvalidInputError
from generated.esurge.v1 import engine_pb2
from service.convert import SAMPLING_FIELDS, GenerationRequest, engine_request_from_proto
from service.errors import (
    FieldViolation,
    InvalidFieldError,
    field_name_from_message,
    internal,
    invalid_argument,
    join_field_path,
    resource_exhausted,
)
from service.info import MAX_N

if TYPE_CHECKING:
    from esurge.engine.api import eSurge
    from service.bridge import EngineBridge, Sink

__all__ = [
    "REQUEST_ID_METADATA",
    "AdmissionPolicy",
    "engine_error_violation",
    "metadata_request_id",
    "new_request_id",
    "parse_request",
    "submit_or_status",
]

# Metadata key a client (or a proxy) may set to choose the request id; the
# server echoes the id in effect under the same key in the initial metadata.
REQUEST_ID_METADATA = "x-request-id"

# Message starts of the engine's own (non-sampling) refusals -> the field at fault.
_PROMPT_FIELD = "prompt"
_ENGINE_MESSAGE_FIELDS: tuple[tuple[str, str], ...] = (
    ("prompt_token_ids", _PROMPT_FIELD),
    ("prompt must not be empty", _PROMPT_FIELD),
    ("prompt is text", _PROMPT_FIELD),
    ("prompt (", "sampling_params.max_tokens"),
    ("request_id", "request_id"),
)


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


# Library field names of chat input errors -> the proto field under the request.
_CHAT_FIELDS = {"chat": "chat", "messages": "chat.messages", "messages.role": "chat.messages",
                "messages.content": "chat.messages", "template_kwargs": "chat.template_kwargs",
                "add_generation_prompt": "chat.add_generation_prompt"}


def _engine_refusal_field(message: str, request: GenerationRequest) -> str | None:
    if message.startswith("request id ") and "already in use" in message:
        return "request_id"
    if message.startswith("request ") and "max_model_len" in message:
        # The scheduler's fit check: with a cap, the cap is what to lower.
        if request.sampling_params.max_tokens is None:
            return _prompt_field(request)
        return "sampling_params.max_tokens"
    if message.startswith("request ") and "pages" in message:
        return "sampling_params.max_tokens"
    for start, field in _ENGINE_MESSAGE_FIELDS:
        if message.startswith(start):
            if field != _PROMPT_FIELD:
                return field
            # Without a tokenizer, a text prompt and bad_words are what fails.
            if start == "prompt is text" and request.prompt_text is None:
                return "sampling_params.bad_words"
            return _prompt_field(request)
    return None


def engine_error_violation(error: ValueError, request: GenerationRequest,
                           field_prefix: str) -> FieldViolation:
    """The violation behind an engine refusal, on the proto field the client set.

    `field_prefix` is the path of the EngineRequest inside the RPC message
    ("request" for Generate). A message naming no known field is reported on
    the request as a whole.
    """
    message = str(error) or type(error).__name__
    if isinstance(error, InvalidInputError) and error.field in _CHAT_FIELDS:
        return FieldViolation(join_field_path(field_prefix, _CHAT_FIELDS[error.field]), message)
    field = _engine_refusal_field(message, request)
    if field is None:
        name = field_name_from_message(message, SAMPLING_FIELDS)
        if name is not None:
            field = f"sampling_params.{name}"
    return FieldViolation(join_field_path(field_prefix, field or ""), message)


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

    def refusal(self, engine: eSurge, bridge: EngineBridge) -> status_pb2.Status | None:
        """RESOURCE_EXHAUSTED when the waiting queue is full, else None."""
        # Requests still on their way into the scheduler will wait too.
        waiting = engine.scheduler.get_request_counts()[1] + bridge.num_submitting
        if waiting < self.max_queued_requests:
            return None
        return resource_exhausted(
            f"{waiting} requests are already waiting (limit {self.max_queued_requests}); "
            f"retry later", self.retry_after_s)


def parse_request(msg: engine_pb2.EngineRequest, prefix: str) -> GenerationRequest:
    """Validate a proto EngineRequest; InvalidFieldError names each bad field."""
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
