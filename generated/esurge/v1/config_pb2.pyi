from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchedulingPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULING_POLICY_UNSPECIFIED: _ClassVar[SchedulingPolicy]
    SCHEDULING_POLICY_FCFS: _ClassVar[SchedulingPolicy]
    SCHEDULING_POLICY_PRIORITY: _ClassVar[SchedulingPolicy]
SCHEDULING_POLICY_UNSPECIFIED: SchedulingPolicy
SCHEDULING_POLICY_FCFS: SchedulingPolicy
SCHEDULING_POLICY_PRIORITY: SchedulingPolicy

class SchedulerConfig(_message.Message):
    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "policy", "long_prefill_token_threshold", "chunked_prefill_enabled", "token_safety_margin", "max_num_seq_buckets", "async_scheduling")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    LONG_PREFILL_TOKEN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_PREFILL_ENABLED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SAFETY_MARGIN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQ_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: SchedulingPolicy
    long_prefill_token_threshold: int
    chunked_prefill_enabled: bool
    token_safety_margin: int
    max_num_seq_buckets: _containers.RepeatedScalarFieldContainer[int]
    async_scheduling: bool
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., policy: _Optional[_Union[SchedulingPolicy, str]] = ..., long_prefill_token_threshold: _Optional[int] = ..., chunked_prefill_enabled: _Optional[bool] = ..., token_safety_margin: _Optional[int] = ..., max_num_seq_buckets: _Optional[_Iterable[int]] = ..., async_scheduling: _Optional[bool] = ...) -> None: ...

class CacheConfig(_message.Message):
    __slots__ = ("num_pages", "page_size", "enable_prefix_caching")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    page_size: int
    enable_prefix_caching: bool
    def __init__(self, num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ...) -> None: ...

class SpeculativeConfig(_message.Message):
    __slots__ = ("num_speculative_tokens", "speculative_model")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_MODEL_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    speculative_model: str
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., speculative_model: _Optional[str] = ...) -> None: ...

class EngineConfig(_message.Message):
    __slots__ = ("scheduler_config", "cache_config", "speculative_config")
    SCHEDULER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    CACHE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    speculative_config: SpeculativeConfig
    def __init__(self, scheduler_config: _Optional[_Union[SchedulerConfig, _Mapping]] = ..., cache_config: _Optional[_Union[CacheConfig, _Mapping]] = ..., speculative_config: _Optional[_Union[SpeculativeConfig, _Mapping]] = ...) -> None: ...
