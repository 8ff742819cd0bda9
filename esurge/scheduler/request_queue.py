"""Waiting queues: first-come-first-served and priority order.

Both queues expose the same small interface so the scheduler has one admission
loop. A preempted request goes back with `add_preempted`: to the front of the
FCFS queue, and into its priority slot in the priority queue.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from esurge.config import SchedulingPolicy
from esurge.request import EngineRequest

__all__ = ["FCFSQueue", "PriorityQueue", "RequestQueue", "create_request_queue", "priority_key"]


def priority_key(request: EngineRequest) -> tuple[int, float, str]:
    """Sort key of the priority policy: lower priority value first, then earlier arrival.

    The request id breaks exact ties so the order is always total and stable.
    """
    return (request.priority, request.arrival_time, request.request_id)


class RequestQueue(ABC):
    """A queue of waiting requests in admission order."""

    @abstractmethod
    def add(self, request: EngineRequest) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def add_preempted(self, request: EngineRequest) -> None:
        """Queue a request that was running and got preempted."""

    @abstractmethod
    def peek(self) -> EngineRequest:
        """The next request to admit; IndexError when empty."""

    @abstractmethod
    def pop(self) -> EngineRequest:
        """Remove and return the next request to admit; IndexError when empty."""

    @abstractmethod
    def remove_many(self, requests: set[EngineRequest]) -> None:
        """Drop the given requests (those not queued are ignored)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[EngineRequest]:
        """Requests in admission order."""


class FCFSQueue(RequestQueue):
    """Admits by arrival; preempted requests jump back to the front."""

    def __init__(self) -> None:
        self._queue: deque[EngineRequest] = deque()

    def add(self, request: EngineRequest) -> None:
        self._queue.append(request)

    def add_preempted(self, request: EngineRequest) -> None:
        self._queue.appendleft(request)

    def peek(self) -> EngineRequest:
        return self._queue[0]

    def pop(self) -> EngineRequest:
        return self._queue.popleft()

    def remove_many(self, requests: set[EngineRequest]) -> None:
        self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[EngineRequest]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    """A heap keyed by `priority_key`: (priority, arrival time), lower first."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], EngineRequest]] = []

    def add(self, request: EngineRequest) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    def add_preempted(self, request: EngineRequest) -> None:
        self.add(request)

    def peek(self) -> EngineRequest:
        return self._heap[0][1]

    def pop(self) -> EngineRequest:
        return heapq.heappop(self._heap)[1]

    def remove_many(self, requests: set[EngineRequest]) -> None:
        self._heap = [entry for entry in self._heap if entry[1] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[EngineRequest]:
        return (entry[1] for entry in sorted(self._heap, key=lambda entry: entry[0]))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """The waiting queue for a scheduling policy."""
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    return FCFSQueue()
