"""Where an engine error's field lives in the API: tables, never message text.

The engine's `InvalidRequestError.field` uses the engine's names
(`esurge.errors.RequestField`, `sampling_params.<option>`); these tables turn
it into the proto field path of the `EngineRequest` the client sent.
"""

from __future__ import annotations

import re
from dataclasses import fields

from esurge.errors import InvalidRequestError, RequestField
from esurge.sampling_params import SamplingParams

__all__ = ["SAMPLING_FIELDS", "engine_field_path", "sampling_field_name"]

# Engine SamplingParams fields a client sets; the proto fields carry the same names.
SAMPLING_FIELDS: frozenset[str] = frozenset(
    f.name for f in fields(SamplingParams) if f.name != "bad_words_token_ids"
)

# Request-level engine fields -> their EngineRequest proto field. The prompt
# is not here: its proto field depends on the form the client sent it in.
_REQUEST_FIELDS: dict[str, str] = {
    RequestField.REQUEST_ID: "request_id",
    RequestField.PRIORITY: "priority",
    RequestField.SAMPLING_PARAMS: "sampling_params",
    RequestField.CHAT: "chat",
    RequestField.CHAT_MESSAGES: "chat.messages",
    RequestField.CHAT_ADD_GENERATION_PROMPT: "chat.add_generation_prompt",
    RequestField.CHAT_TEMPLATE_KWARGS: "chat.template_kwargs",
}
_SAMPLING_PREFIX = RequestField.sampling("")


def sampling_field_name(error: InvalidRequestError) -> str | None:
    """The SamplingParams proto field an error names (`logit_bias[5]`), if any."""
    if not error.field.startswith(_SAMPLING_PREFIX):
        return None
    name = error.field[len(_SAMPLING_PREFIX):]
    # `logit_bias[5]`, `structured_outputs.json`: the option is the leading name.
    return name if re.split(r"[.\[]", name, maxsplit=1)[0] in SAMPLING_FIELDS else None


def engine_field_path(error: InvalidRequestError, prompt_field: str) -> str:
    """The EngineRequest proto field path of an engine refusal ("" when it names none).

    prompt_field: the EngineRequest field the client sent its prompt in
    (`prompt_text`, `prompt_token_ids` or `chat`).
    """
    if error.field == RequestField.PROMPT:
        return prompt_field
    name = sampling_field_name(error)
    if name is not None:
        return f"sampling_params.{name}"
    return _REQUEST_FIELDS.get(error.field, "")
