"""Pure conversions between the `esurge.v1` protos and the engine's types.

Inbound (client -> engine) conversions validate: a bad value raises
`InvalidFieldError` whose violations name the proto field path, e.g.
`request.sampling_params.top_p` when called with `field_prefix="request"`.
Outbound pieces (finish reasons, events, logprobs) trust the engine's
objects; the response messages are assembled in `service.responses`.

Where proto3 cannot tell "unset" from "empty", the mapping is fixed here and
documented per function: an empty repeated field or map is the engine's None
(allowed_token_ids, logit_bias, new_logprobs, finished_requests,
max_num_seq_buckets) and an empty string is None (request_id, cache_salt).
Logprobs travel as 32-bit floats, so they come back rounded to float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from esurge.engine.chat import ChatMessage, ChatPrompt
from esurge.engine_types import (
    EngineCoreEvent,
    EngineCoreEventType,
    FinishReason,
)
from esurge.errors import InvalidRequestError, RequestField
from esurge.outputs import TokenLogprobs
from esurge.sampling_params import SamplingParams
from esurge.structured_output.params import StructuredOutputsParams
from generated.esurge.v1 import engine_pb2, sampling_pb2
from service.config_convert import config_from_proto, config_to_proto
from service.errors import (
    FieldViolation,
    InvalidFieldError,
    join_field_path,
)
from service.field_paths import SAMPLING_FIELDS, sampling_field_name
from service.wire import unknown_field_numbers

__all__ = [
    "SAMPLING_FIELDS", "GenerationRequest", "config_from_proto", "config_to_proto",
    "engine_request_from_proto", "engine_request_to_proto", "event_to_proto",
    "finish_reason_to_proto", "prompt_logprobs_to_proto", "sampling_params_from_proto",
    "sampling_params_to_proto", "set_stop_reason", "structured_outputs_from_proto",
    "structured_outputs_to_proto", "token_logprobs_to_proto",
]

# Optional proto fields passed to SamplingParams only when present, so that an
# unset field takes the engine's own default (one source of truth).
_OPTIONAL_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
    "logprobs", "prompt_logprobs", "skip_special_tokens",
)
# Plain proto3 fields whose zero value is the engine default.
_PLAIN_SAMPLING_FIELDS = (
    "min_p", "presence_penalty", "frequency_penalty", "min_tokens",
    "ignore_eos", "include_stop_str_in_output",
)
_SEQUENCE_SAMPLING_FIELDS = ("stop", "stop_token_ids", "bad_words")

_FINISH_TO_PROTO: dict[FinishReason, engine_pb2.FinishReason] = {
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
}

_EVENT_TO_PROTO: dict[EngineCoreEventType, engine_pb2.EngineCoreEventType] = {
    EngineCoreEventType.QUEUED: engine_pb2.ENGINE_CORE_EVENT_TYPE_QUEUED,
    EngineCoreEventType.SCHEDULED: engine_pb2.ENGINE_CORE_EVENT_TYPE_SCHEDULED,
    EngineCoreEventType.PREEMPTED: engine_pb2.ENGINE_CORE_EVENT_TYPE_PREEMPTED,
}

# ----------------------------------------------------------------- sampling


def sampling_params_from_proto(
    msg: sampling_pb2.SamplingParams, *, field_prefix: str = "sampling_params"
) -> SamplingParams:
    """Validated engine SamplingParams from the proto, honouring field presence.

    Unset optional fields take the engine defaults (temperature 1.0, top_p 1.0,
    max_tokens 16, ...); `max_tokens_unbounded` gives max_tokens None. A bad
    value raises InvalidFieldError naming `field_prefix.<field>`.
    """
    unknown = unknown_field_numbers(msg)
    if unknown:
        # The API refuses what it cannot honour, a newer client's option included.
        raise InvalidFieldError([FieldViolation(
            field_prefix, f"SamplingParams has fields this server does not know: "
                          f"numbers {unknown}")])
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _PLAIN_SAMPLING_FIELDS}
    kwargs.update((name, getattr(msg, name)) for name in _OPTIONAL_SAMPLING_FIELDS
                  if msg.HasField(name))
    kwargs.update((name, tuple(getattr(msg, name))) for name in _SEQUENCE_SAMPLING_FIELDS)
    kwargs["allowed_token_ids"] = tuple(msg.allowed_token_ids) or None
    kwargs["logit_bias"] = dict(sorted(msg.logit_bias.items())) or None
    if msg.HasField("max_tokens"):
        if msg.max_tokens_unbounded:
            raise InvalidFieldError([FieldViolation(
                join_field_path(field_prefix, "max_tokens_unbounded"),
                f"max_tokens_unbounded must be false when max_tokens is set "
                f"(max_tokens={msg.max_tokens})",
            )])
        kwargs["max_tokens"] = msg.max_tokens
    elif msg.max_tokens_unbounded:
        kwargs["max_tokens"] = None
    try:
        if msg.HasField("structured_outputs"):
            kwargs["structured_outputs"] = structured_outputs_from_proto(
                msg.structured_outputs, join_field_path(field_prefix, "structured_outputs"))
        return SamplingParams(**kwargs)
    except InvalidRequestError as err:
        name = sampling_field_name(err)
        field = join_field_path(field_prefix, name) if name is not None else field_prefix
        raise InvalidFieldError([FieldViolation(field, str(err))]) from err


def structured_outputs_from_proto(msg: sampling_pb2.StructuredOutputs, field: str
                                  ) -> StructuredOutputsParams:
    """The engine constraint of a StructuredOutputs message (InvalidRequestError if bad)."""
    unknown = unknown_field_numbers(msg)
    if unknown:
        raise InvalidFieldError([FieldViolation(
            field, f"StructuredOutputs has fields this server does not know: numbers {unknown}")])
    kind = msg.WhichOneof("kind")
    if kind == "json_object" and not msg.json_object:
        raise InvalidFieldError([FieldViolation(
            join_field_path(field, "json_object"), "json_object must be true when set")])
    value: Any = None if kind is None else getattr(msg, kind)
    if kind == "choice":
        value = tuple(msg.choice.choices)
    constraint = {} if kind is None else {kind: value}
    return StructuredOutputsParams(
        **constraint, disable_any_whitespace=msg.disable_any_whitespace,
        disable_additional_properties=msg.disable_additional_properties,
        whitespace_pattern=(msg.whitespace_pattern if msg.HasField("whitespace_pattern")
                            else None))


def structured_outputs_to_proto(params: StructuredOutputsParams
                                ) -> sampling_pb2.StructuredOutputs:
    """The proto form of an engine constraint (a schema as JSON text)."""
    msg = sampling_pb2.StructuredOutputs(
        disable_any_whitespace=params.disable_any_whitespace,
        disable_additional_properties=params.disable_additional_properties)
    if params.whitespace_pattern is not None:
        msg.whitespace_pattern = params.whitespace_pattern
    kind = params.kind
    if kind == "json":
        msg.json = json.dumps(params.schema())
    elif kind == "choice":
        msg.choice.choices.extend(params.choice or ())
    else:
        setattr(msg, kind, getattr(params, kind))
    return msg


def sampling_params_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    """The proto form of engine SamplingParams; every engine default is written out.

    esurge.v1 carries bad words as text, which the server tokenizes: token-id
    bad words without their text cannot be sent (InvalidRequestError).
    """
    if params.bad_words_token_ids and not params.bad_words:
        raise InvalidRequestError(
            RequestField.sampling("bad_words_token_ids"),
            "esurge.v1 has no token-id bad words (the server tokenizes bad_words): send "
            "them as text in bad_words")
    msg = sampling_pb2.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p,
        repetition_penalty=params.repetition_penalty,
        skip_special_tokens=params.skip_special_tokens,
        stop=params.stop, stop_token_ids=params.stop_token_ids, bad_words=params.bad_words,
        allowed_token_ids=params.allowed_token_ids or (),
        logit_bias=params.logit_bias or {},
        max_tokens_unbounded=params.max_tokens is None,
    )
    for name in _PLAIN_SAMPLING_FIELDS:
        setattr(msg, name, getattr(params, name))
    for name in ("top_k", "seed", "logprobs", "prompt_logprobs", "max_tokens"):
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return msg


# ------------------------------------------------------------------ request


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A client request, validated and in engine terms.

    Exactly one of prompt_token_ids / prompt_text / chat is set. request_id
    None means the client left the id to the server; cache_salt None means no
    salt.
    """

    request_id: str | None
    prompt_token_ids: tuple[int, ...] | None
    prompt_text: str | None
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    return_text: bool = True
    return_prompt_token_ids: bool = False
    return_events: bool = False
    chat: ChatPrompt | None = None

    def __post_init__(self) -> None:
        prompts = [p for p in (self.prompt_token_ids, self.prompt_text, self.chat)
                   if p is not None]
        if len(prompts) != 1:
            raise ValueError(
                "exactly one of prompt_token_ids, prompt_text and chat must be set, got "
                f"prompt_token_ids={self.prompt_token_ids!r}, prompt_text={self.prompt_text!r}, "
                f"chat={self.chat!r}"
            )
        if self.request_id == "":
            raise ValueError("request_id must be None or a non-empty string, got ''")
        if self.cache_salt == "":
            raise ValueError("cache_salt must be None or a non-empty string, got ''")


def chat_from_proto(msg: engine_pb2.ChatInput, prefix: str) -> ChatPrompt:
    """The engine's ChatPrompt; InvalidFieldError names the bad field under `prefix`."""
    violations = [FieldViolation(join_field_path(prefix, f"messages[{i}].role"),
                                 "role must not be empty")
                  for i, m in enumerate(msg.messages) if not m.role]
    if not msg.messages:
        violations.append(FieldViolation(join_field_path(prefix, "messages"),
                                         "messages must hold at least one message"))
    if violations:
        raise InvalidFieldError(violations)
    kwargs = json_format.MessageToDict(msg.template_kwargs) if msg.HasField(
        "template_kwargs") else {}
    try:
        return ChatPrompt(
            tuple(ChatMessage(m.role, m.content) for m in msg.messages),
            add_generation_prompt=(msg.add_generation_prompt
                                   if msg.HasField("add_generation_prompt") else True),
            template_kwargs=kwargs)
    except InvalidRequestError as err:  # its field is "chat.<name>": the same path under prefix
        name = "" if err.field == RequestField.CHAT else err.field.removeprefix(
            f"{RequestField.CHAT}.")
        raise InvalidFieldError([FieldViolation(join_field_path(prefix, name), str(err))]) from err


def chat_to_proto(chat: ChatPrompt) -> engine_pb2.ChatInput:
    """The proto form of a ChatPrompt (what a client sends)."""
    msg = engine_pb2.ChatInput(
        messages=[engine_pb2.ChatMessage(role=m.role, content=m.content)
                  for m in chat.messages],
        add_generation_prompt=chat.add_generation_prompt)
    if chat.template_kwargs:
        msg.template_kwargs.update(dict(chat.template_kwargs))
    return msg


def _prompt_from_proto(
    msg: engine_pb2.EngineRequest, prefix: str
) -> tuple[tuple[int, ...] | None, str | None, FieldViolation | None]:
    kind = msg.WhichOneof("prompt")
    if kind == "prompt_token_ids":
        ids = tuple(msg.prompt_token_ids.token_ids)
        if ids:
            return ids, None, None
        return None, None, FieldViolation(join_field_path(prefix, "prompt_token_ids"),
                                          "prompt_token_ids must not be empty")
    if kind == "prompt_text":
        if msg.prompt_text:
            return None, msg.prompt_text, None
        return None, None, FieldViolation(join_field_path(prefix, "prompt_text"),
                                          "prompt_text must not be empty")
    return None, None, FieldViolation(join_field_path(prefix, "prompt"),
                                      "one of prompt_token_ids, prompt_text or chat must be set")


def engine_request_from_proto(
    msg: engine_pb2.EngineRequest, *, field_prefix: str = ""
) -> GenerationRequest:
    """Validate a proto EngineRequest and turn it into a GenerationRequest.

    `field_prefix` is the path of `msg` inside the RPC's request message
    ("request" for Generate); violations are reported below it, every
    violation found at once. Token ids are checked against the vocabulary
    later, by the engine (`SamplingParams.validate_for_vocab`).
    """
    violations: list[FieldViolation] = []
    chat: ChatPrompt | None = None
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    if msg.WhichOneof("prompt") == "chat":
        try:
            chat = chat_from_proto(msg.chat, join_field_path(field_prefix, "chat"))
        except InvalidFieldError as err:
            violations.extend(err.violations)
    else:
        token_ids, text, prompt_problem = _prompt_from_proto(msg, field_prefix)
        if prompt_problem is not None:
            violations.append(prompt_problem)
    params: SamplingParams | None = None
    try:
        params = sampling_params_from_proto(
            msg.sampling_params, field_prefix=join_field_path(field_prefix, "sampling_params"))
    except InvalidFieldError as err:
        violations.extend(err.violations)
    if violations or params is None:
        raise InvalidFieldError(violations)
    options = msg.output_options
    return GenerationRequest(
        request_id=msg.request_id or None,
        prompt_token_ids=token_ids,
        prompt_text=text,
        sampling_params=params,
        priority=msg.priority,
        cache_salt=msg.cache_salt or None,
        return_text=options.return_text if options.HasField("return_text") else True,
        return_prompt_token_ids=options.return_prompt_token_ids,
        return_events=options.return_events,
        chat=chat,
    )


def engine_request_to_proto(request: GenerationRequest) -> engine_pb2.EngineRequest:
    """The proto form of a GenerationRequest (what a client sends)."""
    msg = engine_pb2.EngineRequest(
        request_id=request.request_id or "",
        sampling_params=sampling_params_to_proto(request.sampling_params),
        priority=request.priority,
        cache_salt=request.cache_salt or "",
        output_options=engine_pb2.OutputOptions(
            return_text=request.return_text,
            return_prompt_token_ids=request.return_prompt_token_ids,
            return_events=request.return_events,
        ),
    )
    if request.prompt_token_ids is not None:
        msg.prompt_token_ids.token_ids.extend(request.prompt_token_ids)
    elif request.prompt_text is not None:
        msg.prompt_text = request.prompt_text
    elif request.chat is not None:
        msg.chat.CopyFrom(chat_to_proto(request.chat))
    return msg


# ------------------------------------------------------------------ outputs


def finish_reason_to_proto(reason: FinishReason | None) -> engine_pb2.FinishReason:
    """The proto finish reason; None (still running) is FINISH_REASON_UNSPECIFIED."""
    return engine_pb2.FINISH_REASON_UNSPECIFIED if reason is None else _FINISH_TO_PROTO[reason]


def set_stop_reason(msg: Any, stop_reason: int | str | None) -> None:
    """Fill the `stop_reason` oneof of `msg` (EngineCoreOutput, GenerateResponse or
    Completion): an int is a stop token id, a str a stop string, None neither."""
    if isinstance(stop_reason, bool):
        raise ValueError(f"stop_reason must be an int, a str or None, got {stop_reason!r}")
    if isinstance(stop_reason, int):
        if stop_reason < 0:
            raise ValueError(f"stop_reason token id must be >= 0, got {stop_reason}")
        msg.stop_token_id = stop_reason
    elif isinstance(stop_reason, str):
        msg.stop_string = stop_reason
    elif stop_reason is not None:
        raise ValueError(f"stop_reason must be an int, a str or None, got {stop_reason!r}")


def event_to_proto(event: EngineCoreEvent) -> engine_pb2.EngineCoreEvent:
    """The proto form of one lifecycle event."""
    return engine_pb2.EngineCoreEvent(type=_EVENT_TO_PROTO[event.type], timestamp=event.timestamp)


def token_logprobs_to_proto(logprobs: TokenLogprobs) -> engine_pb2.TokenLogprobs:
    """The proto form of one position's logprobs (values become float32)."""
    return engine_pb2.TokenLogprobs(
        token_ids=logprobs.token_ids, logprobs=logprobs.logprobs, rank=logprobs.rank
    )


def prompt_logprobs_to_proto(
    entries: list[TokenLogprobs | None],
) -> list[engine_pb2.PositionLogprobs]:
    """Per-position prompt logprobs; a None position becomes an empty entry."""
    return [
        engine_pb2.PositionLogprobs() if entry is None
        else engine_pb2.PositionLogprobs(logprobs=token_logprobs_to_proto(entry))
        for entry in entries
    ]
