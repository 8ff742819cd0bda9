"""Errors that carry the field at fault, so callers never parse a message.

Raised where each rule lives (SamplingParams, the input processor, the
scheduler's admission check, the configs). They subclass ValueError, so
library users who catch ValueError keep working; servers map `field` to
their own names (a proto field path, a command-line flag) with a table.
"""

from __future__ import annotations

__all__ = ["FieldError", "InvalidConfigError", "InvalidRequestError", "RequestField"]


class FieldError(ValueError):
    """A refused value; `field` names it, the message says what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class InvalidRequestError(FieldError):
    """A request the engine refuses.

    field is one of `RequestField`'s names, or `sampling_params.<name>` (with
    an index for an entry, e.g. `sampling_params.logit_bias[5]`) for an
    option of SamplingParams.
    """


class InvalidConfigError(FieldError):
    """An engine setting refused; field is the config field's name (`max_num_seqs`)."""


class RequestField:
    """The request-level field names InvalidRequestError uses."""

    # The prompt, whether it came as text or as token ids.
    PROMPT = "prompt"
    REQUEST_ID = "request_id"
    PRIORITY = "priority"
    SAMPLING_PARAMS = "sampling_params"
    # A conversation for the chat template: the whole of it (no template to
    # render it with), its messages, or its template settings.
    CHAT = "chat"
    CHAT_MESSAGES = "chat.messages"
    CHAT_ADD_GENERATION_PROMPT = "chat.add_generation_prompt"
    CHAT_TEMPLATE_KWARGS = "chat.template_kwargs"

    @staticmethod
    def sampling(name: str) -> str:
        """The field of one SamplingParams option."""
        return f"sampling_params.{name}"
