"""EngineCore: one step is schedule -> execute -> update_from_output.

With async scheduling the core keeps one step in flight: step N+1 is
scheduled and dispatched to the device before step N's tokens are applied,
so host work overlaps device work. The scheduler's placeholders make the two
modes produce the same tokens. A speculative step pipelines too when it
hands the drafts it proposes to the scheduler at dispatch (drafts_ahead):
the next step verifies them, laid out as if every draft in flight were
accepted, and the device moves it back over the rejected ones. A step the
executor says does not pipeline (a speculative one that cannot: how many
drafts it accepts moves every position after it) is collected before the
next is scheduled (a speculative step's collect waits for its verification,
while the device drafts the next step's tokens); the next is then
dispatched at once, before the collected step's
outputs are returned, so that the caller's work on them (detokenizing, stop
strings, delivery) overlaps the device instead of idling it. Before each
schedule the executor may name requests to move back and compute again
(`resyncs`: a draft head that missed their plain steps); the scheduler moves
those with no step in flight (Scheduler.rewind).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from esurge.engine_types import EngineCoreOutputs
from esurge.outputs import ModelRunnerOutput
from esurge.request import EngineRequest, EngineRequestStatus
from esurge.scheduler.interface import SchedulerInterface
from esurge.scheduler.output import SchedulerOutput

__all__ = ["EngineCore", "ModelExecutor", "PendingStep"]


# A step dispatched to the device whose results are not read yet.
PendingStep = TypeVar("PendingStep")


class ModelExecutor(Protocol[PendingStep]):
    """What the core needs from a model runner."""

    def dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Start a step on the device and return without waiting for it."""
        ...

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a dispatched step and return its results."""
        ...

    def pipelines(self, pending: PendingStep) -> bool:
        """Whether the next step may be scheduled before this one is collected."""
        ...

    def drafts_ahead(self, pending: PendingStep) -> Mapping[str, Sequence[int]]:
        """Drafts a pipelining step proposed for the next step, by request (may be empty)."""
        ...

    def resyncs(self) -> Mapping[str, int]:
        """Requests to compute again from these positions before the next step
        (see Scheduler.rewind; may be empty)."""
        ...

    def rewound(self, computed: Mapping[str, int]) -> None:
        """The requests the scheduler moved back (resyncs), with how far each
        had computed."""
        ...


class EngineCore(Generic[PendingStep]):
    """Drives a scheduler and a model executor, one forward pass per step."""

    def __init__(self, scheduler: SchedulerInterface, executor: ModelExecutor[PendingStep],
                 async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self._in_flight: deque[tuple[SchedulerOutput, PendingStep]] = deque()
        # Steps dispatched while an earlier one was still running.
        self.num_overlapped_steps = 0
        # Steps dispatched right after a barrier step was collected, before
        # its outputs were returned.
        self.num_early_steps = 0
        # Speculative steps that handed their drafts to the next step at dispatch.
        self.num_drafts_ahead = 0
        # Requests moved back to compute again what their draft head missed.
        self.num_rewound = 0

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (ValueError if the scheduler refuses it)."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: EngineRequestStatus = EngineRequestStatus.FINISHED_ABORTED) -> None:
        """End requests now; their pages are freed at once."""
        self.scheduler.finish_requests(list(request_ids), status)

    def has_work(self) -> bool:
        """True while a step is in flight or the scheduler has anything to do."""
        return bool(self._in_flight) or self.scheduler.has_requests()

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Run one step; returns outputs keyed by client index (possibly empty)."""
        if self.async_scheduling:
            return self._step_pipelined()
        if not self.scheduler.has_requests():
            return {}
        scheduler_output = self._schedule()
        runner_output = self.executor.collect(self.executor.dispatch(scheduler_output))
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_pipelined(self) -> dict[int, EngineCoreOutputs]:
        fresh: SchedulerOutput | None = None
        in_flight = self._in_flight
        barrier = bool(in_flight) and not self.executor.pipelines(in_flight[-1][1])
        if barrier and len(in_flight) == 1:
            return self._step_past_barrier()
        if self.scheduler.has_requests() and len(in_flight) < 2 and not barrier:
            # Even an empty schedule is dispatched: it carries the ids of
            # finished requests the runner must drop.
            scheduler_output = self._schedule()
            pending = self._dispatch(scheduler_output)
            if in_flight:
                self.num_overlapped_steps += 1
            in_flight.append((scheduler_output, pending))
            fresh = scheduler_output
        if not in_flight:
            return {}
        if len(in_flight) == 1 and fresh is not None and not fresh.is_empty():
            if self.executor.pipelines(in_flight[0][1]):
                return {}  # keep the device busy: collect once the next step is queued
            # A barrier dispatched alone (every step of a speculative batch is
            # one): collecting it here and returning would leave nothing in
            # flight, so the step after it would again be scheduled only
            # after its outputs were handled, with the device idle meanwhile.
            return self._step_past_barrier()
        scheduler_output, pending = in_flight.popleft()
        runner_output = self.executor.collect(pending)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_past_barrier(self) -> dict[int, EngineCoreOutputs]:
        """Collect the one step in flight, a barrier, and queue the next before
        handing its outputs back."""
        scheduler_output, pending = self._in_flight.popleft()
        outputs = self.scheduler.update_from_output(scheduler_output,
                                                    self.executor.collect(pending))
        if self.scheduler.has_requests():
            scheduler_output = self._schedule()
            self._in_flight.append((scheduler_output, self._dispatch(scheduler_output)))
            self.num_early_steps += 1
        return outputs

    def _schedule(self) -> SchedulerOutput:
        """The next step, after moving back the requests the executor wants
        computed again (those with a step in flight stay)."""
        wanted = self.executor.resyncs()
        if wanted:
            moved = self.scheduler.rewind(wanted)
            self.executor.rewound(moved)
            self.num_rewound += len(moved)
        return self.scheduler.schedule()

    def _dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Start a step; drafts it hands ahead go to the scheduler at once, for
        the step scheduled before this one is read to verify."""
        pending = self.executor.dispatch(scheduler_output)
        drafts = self.executor.drafts_ahead(pending)
        if drafts:
            self.scheduler.take_drafts(drafts)
            self.num_drafts_ahead += 1
        return pending

    def shutdown(self) -> None:
        """Drain the in-flight steps and release the scheduler."""
        while self._in_flight:
            scheduler_output, pending = self._in_flight.popleft()
            self.scheduler.update_from_output(scheduler_output, self.executor.collect(pending))
        self.scheduler.shutdown()
        release = getattr(self.executor, "shutdown", None)  # a multi-host executor's followers
        if release is not None:
            release()
