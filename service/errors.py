"""Rich gRPC error statuses (`google.rpc.Status` with typed details).

The servicer refuses work with these helpers so that every client, in any
language, can read *why* from the standard `grpc-status-details-bin` trailer:

- bad input: INVALID_ARGUMENT with a `google.rpc.BadRequest` whose field
  violations name the proto field path (e.g. `request.sampling_params.top_p`);
- overload: RESOURCE_EXHAUSTED with a `google.rpc.RetryInfo` delay;
- draining for shutdown: UNAVAILABLE, optionally with a `RetryInfo`;
- engine failure: INTERNAL with a `google.rpc.ErrorInfo` reason.

From a `grpc.aio` servicer: `await abort_with_status(context, invalid_argument(...))`.
On an EngineStream, where one bad request must not end the stream, the same
status goes into a `RequestRejection` via `rejection_from_status`.

The engine's errors carry their field (`esurge.errors.InvalidRequestError`);
`service.field_paths` maps it to the proto field path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from generated.esurge.v1 import service_pb2

__all__ = [
    "ERROR_DOMAIN",
    "FieldViolation",
    "InvalidFieldError",
    "abort_with_status",
    "clip",
    "field_violations",
    "internal",
    "invalid_argument",
    "join_field_path",
    "rejection_from_status",
    "resource_exhausted",
    "retry_delay_s",
    "status_from_rpc_error",
    "to_grpc_status",
    "unavailable",
]

# `google.rpc.ErrorInfo.domain` of every error this server raises.
ERROR_DOMAIN = "esurge.v1"

@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad request field: its proto path and what is wrong with it."""

    field: str
    description: str

    def __post_init__(self) -> None:
        if not self.description:
            raise ValueError(f"description of the violation of {self.field!r} must not be empty")


class InvalidFieldError(ValueError):
    """Bad client input, naming each bad field by its proto path.

    Raised by `service.convert`; the servicer turns it into an
    INVALID_ARGUMENT status with `invalid_argument(err.violations)`.
    """

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        if not violations:
            raise ValueError("InvalidFieldError needs at least one field violation")
        self.violations: tuple[FieldViolation, ...] = tuple(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))


def join_field_path(prefix: str, name: str) -> str:
    """`prefix.name`, or just the non-empty one of the two."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


# A status travels in trailers twice (grpc-message, percent-encoded, and inside
# grpc-status-details-bin, base64), and clients drop trailers over 8 KiB by
# default: a refusal echoing a long value would reach them as RESOURCE_EXHAUSTED
# "metadata size exceeds soft limit" instead. These bounds keep the worst case
# (every character percent-encoded) under about 6 KiB.
MAX_MESSAGE_BYTES = 600
MAX_FIELD_BYTES = 160
MAX_DESCRIPTION_BYTES = 240
MAX_VIOLATIONS = 8


def clip(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8, saying how much was cut."""
    data = text.encode("utf-8", "replace")
    if len(data) <= max_bytes:
        return text
    note = f"... [{len(data)} bytes, cut]"
    kept = data[:max(0, max_bytes - len(note))].decode("utf-8", "ignore")
    return kept + note


def _status(code: int, message: str, *details: Any) -> status_pb2.Status:
    status = status_pb2.Status(code=code, message=clip(message, MAX_MESSAGE_BYTES))
    for detail in details:
        status.details.add().Pack(detail)
    return status


def _duration(seconds: float, what: str) -> duration_pb2.Duration:
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {seconds!r}")
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(seconds * 1e9))
    return duration


def invalid_argument(
    violations: Sequence[FieldViolation], message: str | None = None
) -> status_pb2.Status:
    """INVALID_ARGUMENT with a BadRequest listing every violation.

    The message defaults to the violations joined, so clients that only read
    the status message still see the field names.
    """
    if not violations:
        raise ValueError("invalid_argument needs at least one field violation")
    bad_request = error_details_pb2.BadRequest()
    for violation in violations[:MAX_VIOLATIONS]:
        bad_request.field_violations.add(
            field=clip(violation.field, MAX_FIELD_BYTES),
            description=clip(violation.description, MAX_DESCRIPTION_BYTES),
        )
    text = message or "; ".join(f"{v.field}: {v.description}" for v in violations)
    if len(violations) > MAX_VIOLATIONS:
        text = f"{len(violations)} fields are invalid, the first {MAX_VIOLATIONS} listed: {text}"
    return _status(code_pb2.INVALID_ARGUMENT, text, bad_request)


def resource_exhausted(
    message: str, retry_after_s: float, reason: str = "OVERLOADED"
) -> status_pb2.Status:
    """RESOURCE_EXHAUSTED with a RetryInfo telling the client when to retry."""
    retry = error_details_pb2.RetryInfo(retry_delay=_duration(retry_after_s, "retry_after_s"))
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)
    return _status(code_pb2.RESOURCE_EXHAUSTED, message, retry, info)


def unavailable(
    message: str, retry_after_s: float | None = None, reason: str = "DRAINING"
) -> status_pb2.Status:
    """UNAVAILABLE, e.g. while draining for shutdown; RetryInfo when a delay is given."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)
    if retry_after_s is None:
        return _status(code_pb2.UNAVAILABLE, message, info)
    retry = error_details_pb2.RetryInfo(retry_delay=_duration(retry_after_s, "retry_after_s"))
    return _status(code_pb2.UNAVAILABLE, message, retry, info)


def internal(message: str, reason: str = "ENGINE_FAILURE") -> status_pb2.Status:
    """INTERNAL with an ErrorInfo reason; the message must not leak internals."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN)
    return _status(code_pb2.INTERNAL, message, info)


def to_grpc_status(status: status_pb2.Status) -> Any:
    """The `grpc.Status` carrying `status` in its trailing metadata."""
    if status.code == code_pb2.OK:
        raise ValueError("to_grpc_status needs an error status, got code OK")
    return rpc_status.to_status(status)


async def abort_with_status(context: Any, status: status_pb2.Status) -> NoReturn:
    """End the current `grpc.aio` call with `status`; never returns.

    `context` is the call's `grpc.aio.ServicerContext`.
    """
    await context.abort_with_status(to_grpc_status(status))
    # abort_with_status always raises; this keeps the NoReturn promise if it does not.
    raise RuntimeError("grpc context.abort_with_status returned")


def status_from_rpc_error(error: Any) -> status_pb2.Status | None:
    """The rich status of a failed call (a `grpc.RpcError` / `grpc.aio.AioRpcError`).

    None when the server sent no `google.rpc.Status` details.
    """
    status: status_pb2.Status | None = rpc_status.from_call(error)
    return status


def field_violations(status: status_pb2.Status) -> tuple[FieldViolation, ...]:
    """The BadRequest field violations packed in `status`, in order."""
    found: list[FieldViolation] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            found.extend(
                FieldViolation(field=v.field, description=v.description)
                for v in bad_request.field_violations
            )
    return tuple(found)


def retry_delay_s(status: status_pb2.Status) -> float | None:
    """The RetryInfo delay packed in `status`, in seconds; None if there is none."""
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            return float(retry.retry_delay.ToNanoseconds()) / 1e9
    return None


def rejection_from_status(
    request_id: str, status: status_pb2.Status
) -> service_pb2.RequestRejection:
    """An EngineStream rejection of `request_id` carrying the same code, message and details."""
    rejection = service_pb2.RequestRejection(
        request_id=request_id, code=status.code, message=status.message
    )
    rejection.details.extend(status.details)
    return rejection
