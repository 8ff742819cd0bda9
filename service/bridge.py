"""From the engine's own thread to asyncio: per-request queues for the servicer.

The engine (`esurge.engine.loop.EngineLoop`) calls each request's callback on
its thread with a `RequestDelta` after every step that produced something
for it. The bridge turns
those calls into items on the asyncio queue ("sink") the request was
submitted with, on the event loop's thread. Queues are unbounded on purpose:
a slow client only grows its own queue; the engine thread never waits for a
consumer, so one slow stream cannot stall the others.

Crossing threads costs a wake-up of the event loop; the bridge posts at most
one wake-up at a time (`call_soon_threadsafe`) and delivers everything that
arrived meanwhile in one go, so a step that produced outputs for 64 requests
costs one wake-up, not 64.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from esurge.engine.chat import ChatPrompt
from esurge.engine.inputs import Prompt
from esurge.engine.loop import EngineDeadError
from esurge.engine.request_output import RequestDelta, RequestOutput
from esurge.errors import InvalidRequestError, RequestField
from esurge.sampling_params import SamplingParams

if TYPE_CHECKING:
    from esurge.engine.api import eSurge

__all__ = ["Aborted", "BridgeItem", "EngineBridge", "Sink", "drain"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Aborted:
    """The server ended the request before the engine finished it (Abort, cancel, close)."""

    request_id: str


# What a sink receives: a step's delta, the engine's death, or an abort.
BridgeItem = RequestDelta | EngineDeadError | Aborted
T = TypeVar("T")


class Sink(Protocol):
    """A request's destination, an asyncio.Queue; several requests may share one
    (EngineStream), and it may carry the stream's own items besides."""

    def put_nowait(self, item: tuple[str, BridgeItem], /) -> None:
        """Queue one (request id, item) pair without waiting."""


async def drain(queue: asyncio.Queue[tuple[str, T]]) -> list[tuple[str, T]]:
    """Wait for at least one item, then take everything queued, in order.

    Each engine step's output for a request is one delta, so a reader that
    fell behind sends one message per step it missed, nothing twice.
    """
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _retrieve(future: Future[None]) -> None:
    """Mark a refusal nobody waits for as seen (no 'never retrieved' warning)."""
    if not future.cancelled():
        future.exception()


class EngineBridge:
    """Submits requests to one engine and routes their outputs to asyncio queues.

    Every method except the engine-thread callback runs on the event loop
    that created the bridge.
    """

    def __init__(self, engine: eSurge, loop: asyncio.AbstractEventLoop,
                 on_engine_dead: Callable[[EngineDeadError], None] | None = None) -> None:
        self.engine = engine
        self._loop = loop
        self._on_engine_dead = on_engine_dead
        self._sinks: dict[str, Sink] = {}
        # Filled by the engine thread, emptied by the loop thread. deque
        # appends and pops are atomic, so no lock is needed.
        self._arrived: collections.deque[
            tuple[str, RequestDelta | RequestOutput | EngineDeadError]] = collections.deque()
        self._wakeup_posted = False
        # Few workers: tokenizing is CPU work, bounded per request by the
        # engine's text length limit; more threads would only contend.
        self._tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="esurge-tokenize")
        # Requests on their way into the scheduler. A request leaves this set on
        # the engine loop's thread the moment the loop accepts it (it is counted
        # as waiting in the loop's next stats from then): left on the event loop
        # instead, a burst of streams was counted twice for a moment, as
        # submitting and as waiting, and refused as overload well under the
        # limit (32 streams against a limit of 40).
        self._submitting: set[str] = set()

    @property
    def num_submitting(self) -> int:
        """Requests submitted here that the engine loop has not accepted yet."""
        return len(self._submitting)

    def is_live(self, request_id: str) -> bool:
        """True while the request was submitted here and has not ended."""
        return request_id in self._sinks

    @property
    def num_live(self) -> int:
        """Requests submitted through this bridge that have not ended."""
        return len(self._sinks)

    async def submit(self, request_id: str, prompt: Prompt, params: SamplingParams,
                     sink: Sink, *, priority: int = 0, cache_salt: str | None = None) -> None:
        """Validate and queue a request; its outputs will arrive on `sink`.

        Raises the engine's InvalidRequestError (naming the bad field) for bad
        input or a request id that is already in flight, and EngineDeadError
        when the engine is not running. Returns once the scheduler accepted it.
        A text prompt, a chat (rendered by the template, then tokenized) or
        bad_words are tokenized on a worker thread, never on the event loop.
        """
        if request_id in self._sinks:
            raise InvalidRequestError(RequestField.REQUEST_ID,
                                      f"request_id {request_id!r} is already in flight")
        submit = functools.partial(self._submit_now, request_id, prompt, params, priority,
                                   cache_salt)
        self._sinks[request_id] = sink
        self._submitting.add(request_id)
        queued: asyncio.Future[Future[None]] | None = None
        try:
            if isinstance(prompt, str | ChatPrompt) or params.bad_words:
                queued = self._loop.run_in_executor(self._tokenizing, submit)
                accepted = await asyncio.shield(queued)
            else:
                accepted = submit()
            # Shielded: cancelling this call must never cancel the engine's own
            # future (the loop thread resolves it); the abort below ends the
            # request instead, queued after its submission.
            await asyncio.shield(asyncio.wrap_future(accepted))
        except asyncio.CancelledError:
            # The caller went away while the engine was accepting the request:
            # nobody will read it, so it must not run.
            self._sinks.pop(request_id, None)
            if queued is not None:  # runs at once if the tokenizing already ended
                queued.add_done_callback(lambda q: self._abandon(request_id, q))
            else:
                self.engine.abort(request_id)
                accepted.add_done_callback(_retrieve)
            raise
        except BaseException:
            self._sinks.pop(request_id, None)
            raise
        finally:
            self._submitting.discard(request_id)

    def _submit_now(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    priority: int, cache_salt: str | None) -> Future[None]:
        _, accepted = self.engine.submit_nowait(
            prompt, params, lambda item: self._from_engine(request_id, item),
            request_id=request_id, priority=priority, cache_salt=cache_salt)
        accepted.add_done_callback(lambda _: self._submitting.discard(request_id))
        return accepted

    def _abandon(self, request_id: str, queued: asyncio.Future[Future[None]]) -> None:
        """A cancelled submission's tokenizing ended: abort it if it reached the engine."""
        if queued.cancelled() or queued.exception() is not None:
            return
        self.engine.abort(request_id)
        queued.result().add_done_callback(_retrieve)

    def abort(self, request_id: str) -> bool:
        """Abort a request; its pages are freed by the engine at once.

        Its sink gets a final `Aborted` item. Returns False (and does nothing
        else) when the request is not live here: idempotent.
        """
        sink = self._sinks.pop(request_id, None)
        if sink is None:
            return False
        self.engine.abort(request_id)
        sink.put_nowait((request_id, Aborted(request_id)))
        return True

    def abort_all(self) -> list[str]:
        """Abort every live request (server shutdown); returns their ids."""
        ids = list(self._sinks)
        for request_id in ids:
            self.abort(request_id)
        return ids

    # ---- engine thread -> loop thread -------------------------------------

    def _from_engine(self, request_id: str,
                     item: RequestDelta | RequestOutput | EngineDeadError) -> None:
        """Called on the engine thread: queue the item and wake the loop once."""
        self._arrived.append((request_id, item))
        if self._wakeup_posted:
            return
        self._wakeup_posted = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed: the server is gone
            self._wakeup_posted = False

    def _deliver(self) -> None:
        # Cleared before draining: anything appended after this point posts a
        # new wake-up, so no item can be left behind.
        self._wakeup_posted = False
        dead: EngineDeadError | None = None
        while self._arrived:
            request_id, item = self._arrived.popleft()
            sink = self._sinks.get(request_id)
            if sink is None:
                continue  # aborted here already; its stream has ended
            if isinstance(item, RequestOutput):
                continue  # only final_only callbacks get these; the bridge never asks
            if isinstance(item, EngineDeadError):
                dead = item
                del self._sinks[request_id]
            elif item.finished:
                del self._sinks[request_id]
            sink.put_nowait((request_id, item))
        if dead is not None and self._on_engine_dead is not None:
            self._on_engine_dead(dead)
