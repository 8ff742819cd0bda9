"""Typed input errors: each names the request field at fault.

Callers (the gRPC service, CLIs) map `field` to their own names; nothing
needs to read the message to know which field is wrong.
"""

from __future__ import annotations

__all__ = ["InvalidInputError"]


class InvalidInputError(ValueError):
    """A request input is invalid; `field` is its name in the library's terms
    (e.g. "messages", "prompt"), `message` says what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(message)
