from generated.esurge.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class EngineCoreEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_CORE_EVENT_TYPE_UNSPECIFIED: _ClassVar[EngineCoreEventType]
    ENGINE_CORE_EVENT_TYPE_QUEUED: _ClassVar[EngineCoreEventType]
    ENGINE_CORE_EVENT_TYPE_SCHEDULED: _ClassVar[EngineCoreEventType]
    ENGINE_CORE_EVENT_TYPE_PREEMPTED: _ClassVar[EngineCoreEventType]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
ENGINE_CORE_EVENT_TYPE_UNSPECIFIED: EngineCoreEventType
ENGINE_CORE_EVENT_TYPE_QUEUED: EngineCoreEventType
ENGINE_CORE_EVENT_TYPE_SCHEDULED: EngineCoreEventType
ENGINE_CORE_EVENT_TYPE_PREEMPTED: EngineCoreEventType

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_text", "chat", "sampling_params", "priority", "cache_salt", "output_options")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: TokenIds
    prompt_text: str
    chat: ChatInput
    sampling_params: _sampling_pb2.SamplingParams
    priority: int
    cache_salt: str
    output_options: OutputOptions
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., prompt_text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., output_options: _Optional[_Union[OutputOptions, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "template_kwargs")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    template_kwargs: _struct_pb2.Struct
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("return_text", "return_prompt_token_ids", "return_events")
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_EVENTS_FIELD_NUMBER: _ClassVar[int]
    return_text: bool
    return_prompt_token_ids: bool
    return_events: bool
    def __init__(self, return_text: _Optional[bool] = ..., return_prompt_token_ids: _Optional[bool] = ..., return_events: _Optional[bool] = ...) -> None: ...

class EngineCoreEvent(_message.Message):
    __slots__ = ("type", "timestamp")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    type: EngineCoreEventType
    timestamp: float
    def __init__(self, type: _Optional[_Union[EngineCoreEventType, str]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "rank")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: TokenLogprobs
    def __init__(self, logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...

class EngineCoreOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs", "finish_reason", "stop_token_id", "stop_string", "num_cached_tokens", "events", "num_draft_tokens", "num_accepted_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    new_prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: FinishReason
    stop_token_id: int
    stop_string: str
    num_cached_tokens: int
    events: _containers.RepeatedCompositeFieldContainer[EngineCoreEvent]
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., new_prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., events: _Optional[_Iterable[_Union[EngineCoreEvent, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...

class EngineCoreOutputs(_message.Message):
    __slots__ = ("engine_index", "outputs", "timestamp", "finished_requests")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    outputs: _containers.RepeatedCompositeFieldContainer[EngineCoreOutput]
    timestamp: float
    finished_requests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_index: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[EngineCoreOutput, _Mapping]]] = ..., timestamp: _Optional[float] = ..., finished_requests: _Optional[_Iterable[str]] = ...) -> None: ...
