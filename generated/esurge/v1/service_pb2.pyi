from generated.esurge.v1 import config_pb2 as _config_pb2
from generated.esurge.v1 import engine_pb2 as _engine_pb2
from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _engine_pb2.EngineRequest
    def __init__(self, request: _Optional[_Union[_engine_pb2.EngineRequest, _Mapping]] = ...) -> None: ...

class PromptInfo(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_cached_tokens", "prompt_token_ids")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "num_draft_tokens", "num_accepted_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "prompt_info", "token_ids", "text", "logprobs", "prompt_logprobs", "events", "finish_reason", "stop_token_id", "stop_string", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INFO_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    prompt_info: PromptInfo
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_engine_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_engine_pb2.PositionLogprobs]
    events: _containers.RepeatedCompositeFieldContainer[_engine_pb2.EngineCoreEvent]
    finish_reason: _engine_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., prompt_info: _Optional[_Union[PromptInfo, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_engine_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_engine_pb2.PositionLogprobs, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[_engine_pb2.EngineCoreEvent, _Mapping]]] = ..., finish_reason: _Optional[_Union[_engine_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class GenerateUnaryRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _engine_pb2.EngineRequest
    def __init__(self, request: _Optional[_Union[_engine_pb2.EngineRequest, _Mapping]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("index", "token_ids", "text", "logprobs", "finish_reason", "stop_token_id", "stop_string", "events")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_engine_pb2.TokenLogprobs]
    finish_reason: _engine_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    events: _containers.RepeatedCompositeFieldContainer[_engine_pb2.EngineCoreEvent]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_engine_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_engine_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., events: _Optional[_Iterable[_Union[_engine_pb2.EngineCoreEvent, _Mapping]]] = ...) -> None: ...

class GenerateUnaryResponse(_message.Message):
    __slots__ = ("request_id", "prompt_info", "completions", "prompt_logprobs", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INFO_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_info: PromptInfo
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_engine_pb2.PositionLogprobs]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., prompt_info: _Optional[_Union[PromptInfo, _Mapping]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_engine_pb2.PositionLogprobs, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class RequestIds(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineStreamRequest(_message.Message):
    __slots__ = ("add_request", "abort")
    ADD_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    add_request: _engine_pb2.EngineRequest
    abort: RequestIds
    def __init__(self, add_request: _Optional[_Union[_engine_pb2.EngineRequest, _Mapping]] = ..., abort: _Optional[_Union[RequestIds, _Mapping]] = ...) -> None: ...

class RequestRejection(_message.Message):
    __slots__ = ("request_id", "code", "message", "details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ...) -> None: ...

class EngineStreamResponse(_message.Message):
    __slots__ = ("outputs", "rejection")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FIELD_NUMBER: _ClassVar[int]
    outputs: _engine_pb2.EngineCoreOutputs
    rejection: RequestRejection
    def __init__(self, outputs: _Optional[_Union[_engine_pb2.EngineCoreOutputs, _Mapping]] = ..., rejection: _Optional[_Union[RequestRejection, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecialTokenIds(_message.Message):
    __slots__ = ("bos_token_id", "eos_token_ids", "pad_token_id")
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    def __init__(self, bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ...) -> None: ...

class SupportedOptions(_message.Message):
    __slots__ = ("sampling_params", "max_logprobs", "has_tokenizer", "max_n", "has_chat_template", "structured_output_kinds", "structured_output_backend")
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_KINDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    sampling_params: _containers.RepeatedScalarFieldContainer[str]
    max_logprobs: int
    has_tokenizer: bool
    max_n: int
    has_chat_template: bool
    structured_output_kinds: _containers.RepeatedScalarFieldContainer[str]
    structured_output_backend: str
    def __init__(self, sampling_params: _Optional[_Iterable[str]] = ..., max_logprobs: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., max_n: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., structured_output_kinds: _Optional[_Iterable[str]] = ..., structured_output_backend: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "model_type", "max_model_len", "vocab_size", "special_token_ids", "supported_options", "dtype", "checkpoint_format")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    model_type: str
    max_model_len: int
    vocab_size: int
    special_token_ids: SpecialTokenIds
    supported_options: SupportedOptions
    dtype: str
    checkpoint_format: str
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., model_type: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., special_token_ids: _Optional[_Union[SpecialTokenIds, _Mapping]] = ..., supported_options: _Optional[_Union[SupportedOptions, _Mapping]] = ..., dtype: _Optional[str] = ..., checkpoint_format: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("server_version", "api_version", "library_versions", "config", "page_size", "num_pages", "num_speculative_tokens", "platform", "num_devices", "mesh_axes")
    class LibraryVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class MeshAxesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    API_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    MESH_AXES_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    api_version: str
    library_versions: _containers.ScalarMap[str, str]
    config: _config_pb2.EngineConfig
    page_size: int
    num_pages: int
    num_speculative_tokens: int
    platform: str
    num_devices: int
    mesh_axes: _containers.ScalarMap[str, int]
    def __init__(self, server_version: _Optional[str] = ..., api_version: _Optional[str] = ..., library_versions: _Optional[_Mapping[str, str]] = ..., config: _Optional[_Union[_config_pb2.EngineConfig, _Mapping]] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., platform: _Optional[str] = ..., num_devices: _Optional[int] = ..., mesh_axes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "kv_cache_usage", "num_free_pages", "prefix_cache_hit_rate", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "num_draft_tokens", "num_accepted_tokens", "draining", "mean_acceptance_length", "num_verifications")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_free_pages: int
    prefix_cache_hit_rate: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    draining: bool
    mean_acceptance_length: float
    num_verifications: int
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_free_pages: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., draining: _Optional[bool] = ..., mean_acceptance_length: _Optional[float] = ..., num_verifications: _Optional[int] = ...) -> None: ...
