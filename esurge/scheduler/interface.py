"""The scheduler contract the engine core drives, independent of any policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from esurge.config import Config
from esurge.core.kv_cache_spec import CacheGroupsConfig
from esurge.engine_types import EngineCoreOutputs
from esurge.outputs import ModelRunnerOutput
from esurge.request import EngineRequest, EngineRequestStatus
from esurge.scheduler.output import SchedulerOutput

__all__ = ["SchedulerInterface", "SchedulerSource"]


class SchedulerSource(Protocol):
    """What `Scheduler.from_runner` reads from a runner (eSurgeRunner has it all)."""

    @property
    def config(self) -> Config:
        """The engine configuration the runner was built for."""

    @property
    def cache_groups(self) -> CacheGroupsConfig:
        """The runner's KV cache groups over the page pool it allocated."""

    @property
    def max_model_len(self) -> int:
        """The longest sequence the runner's buckets and page tables hold."""

    @property
    def decode_steps(self) -> int:
        """Decode iterations per burst the runner compiled (1: no bursts)."""


class SchedulerInterface(ABC):
    """What an engine core needs from a scheduler: one step is
    `schedule()` -> runner -> `update_from_output()`."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Decide which requests run in the next forward pass and how many tokens each."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Apply a step's sampled tokens; return the new outputs keyed by client index."""

    def take_drafts(self, drafts: Mapping[str, Sequence[int]]) -> None:
        """Drafts a step still in flight proposed for the next, by request, so that
        the next is scheduled (to verify them) before that step's output is applied."""
        raise NotImplementedError(f"{type(self).__name__} does not schedule drafts ahead "
                                  "of a step's output")

    def rewind(self, positions: Mapping[str, int]) -> dict[str, int]:
        """Move running requests back to compute again from these positions (the
        pages stay); returns those moved, with how far each had computed. A
        scheduler that cannot moves none."""
        return {}

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Queue a new request."""

    @abstractmethod
    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: EngineRequestStatus
    ) -> None:
        """End requests from outside (abort, stop string) and free their pages."""

    @abstractmethod
    def get_num_unfinished_requests(self) -> int:
        """Requests waiting or running."""

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.get_num_unfinished_requests() > 0

    @abstractmethod
    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting) request counts."""

    @abstractmethod
    def has_finished_requests(self) -> bool:
        """True when requests finished since the last schedule() must still be
        reported to the runner."""

    def has_requests(self) -> bool:
        """True when there is work or finished ids left to hand to the runner."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False when pages are still in use."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release resources held by the scheduler."""
