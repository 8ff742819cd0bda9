"""What one schedule() call decided, and how it moves the requests on."""

from __future__ import annotations

from collections.abc import Sequence

from esurge.core.kv_cache_manager import KVCachePages
from esurge.request import EngineRequest

__all__ = ["StepPlan"]


class StepPlan:
    """What one schedule() call decided, gathered before it is published."""

    __slots__ = ("decode_steps", "new_reqs", "num_scheduled", "preempted", "running",
                 "running_pages", "spec")

    def __init__(self, decode_steps: int = 1) -> None:
        self.decode_steps = decode_steps  # > 1: every running request takes a burst
        self.num_scheduled: dict[str, int] = {}
        self.new_reqs: list[EngineRequest] = []
        self.running: list[EngineRequest] = []
        self.running_pages: list[KVCachePages] = []
        self.spec: dict[str, Sequence[int]] = {}
        self.preempted: set[str] = set()

    def advance(self, async_scheduling: bool) -> None:
        """Count the step's tokens as computed now, so the next step can be planned
        before this one's output arrives (async scheduling: tokens the step will
        sample become placeholders)."""
        num_scheduled = self.num_scheduled
        for requests in (self.running, self.new_reqs):
            for request in requests:
                computed = request.num_computed_tokens + num_scheduled[request.request_id]
                request.num_computed_tokens = computed
                # Reaching the end of the known (and pending) tokens samples one
                # more; a decode burst samples one per iteration.
                if async_scheduling:
                    ahead = computed + 1 - len(request.all_token_ids) - (
                        request.num_output_placeholders)
                    if ahead > 0:
                        request.num_output_placeholders += ahead
