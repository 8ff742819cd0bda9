"""Conversions between the engine's Config family and the esurge.v1 EngineConfig proto."""

from __future__ import annotations

from typing import Literal

from esurge.config import CacheConfig, Config, SchedulerConfig, SchedulingPolicy, SpeculativeConfig
from generated.esurge.v1 import config_pb2

__all__ = ["config_from_proto", "config_to_proto"]

_POLICY_TO_PROTO: dict[SchedulingPolicy, config_pb2.SchedulingPolicy] = {
    SchedulingPolicy.FCFS: config_pb2.SCHEDULING_POLICY_FCFS,
    SchedulingPolicy.PRIORITY: config_pb2.SCHEDULING_POLICY_PRIORITY,
}
_POLICY_FROM_PROTO: dict[int, Literal["priority", "fcfs"]] = {
    config_pb2.SCHEDULING_POLICY_FCFS: "fcfs",
    config_pb2.SCHEDULING_POLICY_PRIORITY: "priority",
}


def config_to_proto(config: Config) -> config_pb2.EngineConfig:
    """The proto form of the engine Config, every field filled in."""
    sched, cache, spec = config.scheduler_config, config.cache_config, config.speculative_config
    msg = config_pb2.EngineConfig(
        scheduler_config=config_pb2.SchedulerConfig(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=sched.max_model_len,
            policy=_POLICY_TO_PROTO[sched.scheduling_policy],
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            chunked_prefill_enabled=sched.chunked_prefill_enabled,
            token_safety_margin=sched.token_safety_margin,
            max_num_seq_buckets=sched.max_num_seq_buckets or (),
            async_scheduling=sched.async_scheduling,
        ),
        cache_config=config_pb2.CacheConfig(
            num_pages=cache.num_pages, page_size=cache.page_size,
            enable_prefix_caching=cache.enable_prefix_caching,
        ),
    )
    if spec is not None:
        msg.speculative_config.CopyFrom(config_pb2.SpeculativeConfig(
            num_speculative_tokens=spec.num_speculative_tokens,
            speculative_model=spec.speculative_model,
        ))
    return msg


def config_from_proto(msg: config_pb2.EngineConfig) -> Config:
    """The engine Config from its proto form (validated by the Config classes)."""
    sched, cache = msg.scheduler_config, msg.cache_config
    if sched.policy not in _POLICY_FROM_PROTO:
        raise ValueError(f"scheduler_config.policy {sched.policy!r} is not fcfs or priority")
    spec: SpeculativeConfig | None = None
    if msg.HasField("speculative_config"):
        spec_msg = msg.speculative_config
        spec = SpeculativeConfig(
            num_speculative_tokens=spec_msg.num_speculative_tokens,
            speculative_model=(spec_msg.speculative_model
                               if spec_msg.HasField("speculative_model") else None),
        )
    return Config(
        scheduler_config=SchedulerConfig(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=sched.max_model_len,
            policy=_POLICY_FROM_PROTO[sched.policy],
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            chunked_prefill_enabled=sched.chunked_prefill_enabled,
            token_safety_margin=(sched.token_safety_margin
                                 if sched.HasField("token_safety_margin") else None),
            max_num_seq_buckets=tuple(sched.max_num_seq_buckets) or None,
            async_scheduling=sched.async_scheduling,
        ),
        cache_config=CacheConfig(
            num_pages=cache.num_pages if cache.HasField("num_pages") else None,
            page_size=cache.page_size,
            enable_prefix_caching=cache.enable_prefix_caching,
        ),
        speculative_config=spec,
    )
