"""The engine's configuration family, field for field the seed's API.

`CacheConfig`, `SchedulerConfig`, `SpeculativeConfig` and `Config` keep the
seed's names, order, types and defaults. Every config is frozen and validated
on construction so a bad value fails where it was written, not deep inside a
jitted step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from esurge.errors import InvalidConfigError

__all__ = [
    "CacheConfig",
    "Config",
    "ParallelConfig",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpeculativeConfig",
]


class SchedulingPolicy(StrEnum):
    """Order in which waiting requests are admitted.

    FCFS admits by arrival time. PRIORITY admits by (priority, arrival time),
    lower priority value first; when pages run out it preempts the running
    request with the highest priority value (latest arrival on ties).
    """

    FCFS = "fcfs"
    PRIORITY = "priority"


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidConfigError(field, f"{field} must be {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache settings.

    num_pages: pages in the pool; None lets the engine size the pool from a
        memory budget once the model is known.
    page_size: tokens per page.
    enable_prefix_caching: share full pages across requests by content hash.
    """

    num_pages: int | None
    page_size: int
    enable_prefix_caching: bool

    def __post_init__(self) -> None:
        if self.num_pages is not None:
            _require(_is_int(self.num_pages) and self.num_pages >= 1,
                     "num_pages", self.num_pages, "None or an int >= 1")
        _require(_is_int(self.page_size) and self.page_size >= 1,
                 "page_size", self.page_size, "an int >= 1")
        _require(isinstance(self.enable_prefix_caching, bool),
                 "enable_prefix_caching", self.enable_prefix_caching, "a bool")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling and batching limits.

    max_num_seqs: most requests running at once.
    max_num_batched_tokens: token budget of one forward pass.
    max_model_len: longest sequence (prompt + output) a request may reach.
    policy: 'fcfs' or 'priority' (lower priority value runs first).
    long_prefill_token_threshold: with chunked prefill, a prompt longer than
        this gets at most this many tokens per step (0 disables the cap).
    chunked_prefill_enabled: split long prompts across steps.
    token_safety_margin: tokens of headroom kept free per running request when
        admitting new ones, so decode steps rarely have to preempt.
    max_num_seq_buckets: request-count buckets the runner pads to.
    async_scheduling: schedule step N+1 while step N runs on the device.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: Literal["priority", "fcfs"] = "fcfs"
    long_prefill_token_threshold: int = 256
    chunked_prefill_enabled: bool = False
    token_safety_margin: int | None = None
    max_num_seq_buckets: tuple[int, ...] | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, name, value, "an int >= 1")
        _require(self.policy in ("fcfs", "priority"), "policy", self.policy,
                 "'fcfs' or 'priority'")
        _require(_is_int(self.long_prefill_token_threshold)
                 and self.long_prefill_token_threshold >= 0,
                 "long_prefill_token_threshold", self.long_prefill_token_threshold,
                 "an int >= 0")
        _require(isinstance(self.chunked_prefill_enabled, bool),
                 "chunked_prefill_enabled", self.chunked_prefill_enabled, "a bool")
        if self.token_safety_margin is not None:
            _require(_is_int(self.token_safety_margin) and self.token_safety_margin >= 0,
                     "token_safety_margin", self.token_safety_margin, "None or an int >= 0")
        if self.max_num_seq_buckets is not None:
            self._check_buckets(self.max_num_seq_buckets)
            object.__setattr__(self, "max_num_seq_buckets", tuple(self.max_num_seq_buckets))
        _require(isinstance(self.async_scheduling, bool),
                 "async_scheduling", self.async_scheduling, "a bool")
        if not self.chunked_prefill_enabled and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidConfigError(
                "max_num_batched_tokens",
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) while chunked_prefill_enabled is False: "
                "a prompt of max_model_len tokens could never be scheduled; raise "
                "max_num_batched_tokens or enable chunked prefill"
            )

    def _check_buckets(self, buckets: tuple[int, ...]) -> None:
        rule = ("a non-empty, strictly increasing tuple of ints in "
                f"[1, max_num_seqs={self.max_num_seqs}]")
        _require(isinstance(buckets, tuple | list) and len(buckets) > 0,
                 "max_num_seq_buckets", buckets, rule)
        ok = all(_is_int(b) and 1 <= b <= self.max_num_seqs for b in buckets) and all(
            a < b for a, b in itertools.pairwise(buckets)
        )
        _require(ok, "max_num_seq_buckets", buckets, rule)

    @property
    def scheduling_policy(self) -> SchedulingPolicy:
        """The policy as an enum."""
        return SchedulingPolicy(self.policy)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: `num_speculative_tokens` drafts per step from the
    Eagle head at `speculative_model` (a local directory)."""

    num_speculative_tokens: int = 0
    speculative_model: str | None = None

    def __post_init__(self) -> None:
        _require(_is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 0,
                 "num_speculative_tokens", self.num_speculative_tokens, "an int >= 0")
        if self.speculative_model is not None:
            _require(isinstance(self.speculative_model, str) and self.speculative_model != "",
                     "speculative_model", self.speculative_model, "None or a non-empty path")
            if self.num_speculative_tokens == 0:
                raise InvalidConfigError(
                    "speculative_model",
                    f"speculative_model is set ({self.speculative_model!r}) but "
                    "num_speculative_tokens is 0: set num_speculative_tokens >= 1 "
                    "or drop speculative_model"
                )

    def use_eagle(self) -> bool:
        """True exactly when a draft model is set and drafts are requested."""
        return self.speculative_model is not None and self.num_speculative_tokens > 0


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many devices, and hosts, one model runs on.

    tensor_parallel_size: devices of the mesh that split every layer
        (attention by heads, the MLP by its intermediate columns, embedding
        and LM head by vocabulary rows); see esurge.models.tensor_parallel.
        Whether the model's heads divide, and whether that many devices
        exist, is checked when the model loads.
    num_hosts: processes that join one JAX job (multi-controller: every host
        runs the same program; esurge.engine.multihost). Each brings
        tensor_parallel_size / num_hosts devices.
    host_rank: this process's rank; 0 is the leader (scheduler, gRPC server),
        the others follow its steps.
    coordinator_address: "host:port" of the JAX coordinator, on the leader;
        the leader also listens for its followers' step channel on port + 1.
    """

    tensor_parallel_size: int = 1
    num_hosts: int = 1
    host_rank: int = 0
    coordinator_address: str | None = None

    def __post_init__(self) -> None:
        _require(_is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
                 "tensor_parallel_size", self.tensor_parallel_size, "an int >= 1")
        _require(_is_int(self.num_hosts) and self.num_hosts >= 1,
                 "num_hosts", self.num_hosts, "an int >= 1")
        _require(_is_int(self.host_rank) and 0 <= self.host_rank < self.num_hosts,
                 "host_rank", self.host_rank, f"an int in [0, num_hosts={self.num_hosts})")
        if self.num_hosts > 1:
            address = self.coordinator_address
            host, _, port = (address or "").rpartition(":")
            _require(bool(host) and port.isdigit() and 0 < int(port) < 65535,
                     "coordinator_address", address, "'host:port' when num_hosts > 1")
            _require(self.tensor_parallel_size % self.num_hosts == 0, "tensor_parallel_size",
                     self.tensor_parallel_size,
                     f"a multiple of num_hosts={self.num_hosts} (each host brings its share)")
        elif self.coordinator_address is not None:
            raise InvalidConfigError("coordinator_address", "coordinator_address is set "
                                     f"({self.coordinator_address!r}) but num_hosts is 1")

    @property
    def is_multihost(self) -> bool:
        """True when this process is one of several hosts of one job."""
        return self.num_hosts > 1

    @property
    def is_leader(self) -> bool:
        """True on the host that schedules and serves (rank 0)."""
        return self.host_rank == 0


@dataclass(frozen=True, slots=True)
class Config:
    """The whole engine configuration."""

    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.scheduler_config, SchedulerConfig),
                 "scheduler_config", self.scheduler_config, "a SchedulerConfig")
        _require(isinstance(self.cache_config, CacheConfig),
                 "cache_config", self.cache_config, "a CacheConfig")
        if self.speculative_config is not None:
            _require(isinstance(self.speculative_config, SpeculativeConfig),
                     "speculative_config", self.speculative_config,
                     "None or a SpeculativeConfig")

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per step, 0 when speculation is off."""
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec is not None and spec.use_eagle() else 0
