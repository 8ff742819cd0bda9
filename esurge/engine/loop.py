"""The engine's busy loop on its own thread, and the thread-safe way in.

Only the loop thread touches the scheduler, the runner and the output
processor. Other threads (the Python API, the gRPC servicer) send commands
through a queue and get results through per-request callbacks, called on the
loop thread with immutable deltas (or, if they ask, the finished result) they
may keep; the engine's numbers they read
from `stats`, an immutable `EngineStats` the loop publishes each turn.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from esurge.core.kv_events import KVEventLog
from esurge.engine.core import EngineCore
from esurge.engine.kv_event_feed import KVEventFeed
from esurge.engine.output_processor import OutputProcessor
from esurge.engine.request_output import RequestDelta, RequestOutput, snapshot
from esurge.engine.stats import EngineStats, StatsRecorder
from esurge.errors import InvalidRequestError, RequestField
from esurge.request import EngineRequest, EngineRequestStatus
from esurge.sampling_params import SamplingParams

if TYPE_CHECKING:
    from esurge.structured_output.compiler import CompiledGrammar

__all__ = ["EngineDeadError", "EngineLoop", "FinishListener", "OutputCallback", "Submission"]

log = logging.getLogger(__name__)


# How long `EngineLoop.fail` lets the loop stop by itself before failing its
# requests from outside.
FORCED_FAIL_S = 2.0


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; the request cannot complete."""


# A streaming subscriber gets each step's RequestDelta; a final_only one the
# finished RequestOutput; either may get the engine's death instead.
OutputCallback = Callable[[RequestOutput | RequestDelta | EngineDeadError], None]
# Told of every request that ended (finished, or aborted: the flag), on the
# loop thread, with the request's cumulative output (metrics read it).
FinishListener = Callable[[RequestOutput, bool], None]


@dataclass(slots=True)
class Submission:
    """One request on its way to the loop (EngineLoop.stage); `accepted`
    resolves once the scheduler took it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    make_requests: Callable[[list[str]], list[EngineRequest]]
    callback: OutputCallback
    accepted: Future[None]
    final_only: bool = False
    # The output constraint being compiled; the request waits (parked, not in
    # the scheduler) until it is ready or its deadline passes.
    grammar: Future[CompiledGrammar] | None = None
    deadline: float = field(default=0.0)


@dataclass(slots=True)
class _SubmitAll:
    """Submissions the loop adds in one drain, so one step admits them all."""

    submissions: tuple[Submission, ...]


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Fail:
    error: BaseException


@dataclass(slots=True)
class _GrammarReady:
    cmd: Submission


class EngineLoop:
    """Runs EngineCore.step() on a daemon thread while there is work."""

    def __init__(self, core: EngineCore, processor: OutputProcessor,
                 recorder: StatsRecorder, kv_log: KVEventLog | None = None) -> None:
        self.core = core
        self.processor = processor
        self._recorder = recorder
        # Replaced (never mutated) by the loop thread: any thread may read it.
        self.stats: EngineStats = recorder.read()
        self._commands: queue.SimpleQueue[_SubmitAll | _Abort | _GrammarReady | _Fail | None] = (
            queue.SimpleQueue())
        # Requests waiting for their grammar, by id (loop thread only).
        self._parked: dict[str, Submission] = {}
        self._callbacks: dict[str, OutputCallback] = {}
        self._final_only: set[str] = set()  # requests whose callback wants the last output only
        self._thread = threading.Thread(target=self._run, name="esurge-engine", daemon=True)
        self._fail_lock = threading.Lock()
        self._stopping = False
        self.error: BaseException | None = None
        self._finish_listeners: list[FinishListener] = []
        # The prefix cache's stores and evictions, for cache-aware gateways.
        self.kv_events = KVEventFeed()
        self._kv_log = kv_log

    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    @property
    def num_steps(self) -> int:
        """Engine steps run so far (as of the last published stats)."""
        return self.stats.num_steps

    @property
    def alive(self) -> bool:
        """True while the loop runs and has not failed."""
        return self._thread.is_alive() and self.error is None and not self._stopping

    def submit(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
               params: SamplingParams, make_requests: Callable[[list[str]], list[EngineRequest]],
               callback: OutputCallback, final_only: bool = False,
               grammar: Future[CompiledGrammar] | None = None,
               grammar_timeout: float = 30.0) -> Future[None]:
        """Queue a request. The future resolves once the scheduler accepted it,
        or fails with the scheduler's ValueError. make_requests builds the
        engine requests for the given sample ids (on the loop thread).
        The callback gets a RequestDelta per step, or with final_only the
        finished RequestOutput only. A request with a grammar still compiling
        is accepted once it compiled; a compile error, or no grammar after
        grammar_timeout seconds, fails the future with an InvalidRequestError."""
        submission = self.stage(request_id, prompt, prompt_token_ids, params, make_requests,
                                callback, final_only, grammar, grammar_timeout)
        self.submit_all([submission])
        return submission.accepted

    def stage(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
              params: SamplingParams, make_requests: Callable[[list[str]], list[EngineRequest]],
              callback: OutputCallback, final_only: bool = False,
              grammar: Future[CompiledGrammar] | None = None,
              grammar_timeout: float = 30.0) -> Submission:
        """A request as `submit` takes it, not queued yet (submit_all queues it)."""
        deadline = time.monotonic() + grammar_timeout
        return Submission(request_id, prompt, prompt_token_ids, params, make_requests, callback,
                          Future(), final_only, grammar, deadline)

    def submit_all(self, submissions: Sequence[Submission]) -> None:
        """Queue staged requests as one command: the loop adds them all before
        its next step. Queued one by one, the loop could wake at the first and
        step before the caller had queued the rest (a batch of chats started
        with some of its requests, and with Eagle took a speculative step
        sized for the smaller batch)."""
        if not self.alive:
            for submission in submissions:
                submission.accepted.set_exception(EngineDeadError("the engine is not running"))
            return
        self._commands.put(_SubmitAll(tuple(submissions)))

    def add_finish_listener(self, listener: FinishListener) -> None:
        """Call listener(output, aborted) on the loop thread whenever a request ends.

        Add listeners before requests arrive; a listener must be quick and
        must not keep the output (it is the engine's own, still mutable)."""
        self._finish_listeners.append(listener)

    def _notify_finished(self, output: RequestOutput, aborted: bool) -> None:
        for listener in self._finish_listeners:
            try:
                listener(output, aborted)
            except Exception:  # a broken listener must not take the engine down
                log.exception("finish listener failed")

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still running (idempotent)."""
        self._commands.put(_Abort(request_id))

    def fail(self, error: BaseException, grace_s: float = FORCED_FAIL_S) -> None:
        """End the loop with error from another thread (a multi-host follower
        left): at its next command, as if its step had raised it. A loop still
        running after grace_s is stuck inside a step (a collective waiting for
        the host that left): its requests are failed from here, and `alive`
        turns False, so nothing waits on it."""
        self._commands.put(_Fail(error))
        timer = threading.Timer(grace_s, self._force_fail, args=(error,))
        timer.daemon = True
        timer.start()

    def _force_fail(self, error: BaseException) -> None:
        if not self._thread.is_alive():
            return
        log.error("the engine loop is stuck in a step after %r; failing its requests", error)
        self.error = error
        self._fail_all(EngineDeadError(f"engine loop stopped: {error!r}"))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; requests still running get an EngineDeadError."""
        self._stopping = True
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stopping:
                block = not self.core.has_work()
                if not self._drain_commands(block):
                    break
                if self.core.has_work():
                    self._step()
                self.stats = self._recorder.read()  # after aborts too, even with no step
            self.core.shutdown()
        except BaseException as exc:  # the loop must report, not vanish
            log.exception("engine loop failed")
            self.error = exc
        finally:
            self._fail_all(EngineDeadError(
                f"engine loop stopped: {self.error!r}" if self.error else "engine shut down"))

    def _drain_commands(self, block: bool) -> bool:
        while True:
            timeout = None
            if block and self._parked:  # wake for the first grammar deadline
                timeout = max(0.0, min(c.deadline for c in self._parked.values())
                              - time.monotonic())
            try:
                command = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                self._expire_parked()
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Fail):
                raise command.error
            if isinstance(command, _Abort):
                self._abort(command.request_id)
            elif isinstance(command, _GrammarReady):
                if self._parked.pop(command.cmd.request_id, None) is command.cmd:
                    self._add(command.cmd)
            else:
                for submission in command.submissions:
                    self._add(submission)

    def _park(self, cmd: Submission, grammar: Future[CompiledGrammar]) -> None:
        self._parked[cmd.request_id] = cmd
        grammar.add_done_callback(lambda _: self._commands.put(_GrammarReady(cmd)))

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for rid, cmd in list(self._parked.items()):
            params = cmd.params.structured_outputs
            if cmd.deadline <= now and params is not None:
                del self._parked[rid]
                if cmd.accepted.set_running_or_notify_cancel():
                    cmd.accepted.set_exception(InvalidRequestError(
                        params.field, f"the {params.kind} constraint did not compile in time"))

    def _grammar_of(self, cmd: Submission) -> CompiledGrammar | None:
        """The compiled grammar (None: unconstrained); raises its compile error."""
        return None if cmd.grammar is None else cmd.grammar.result()

    def _add(self, cmd: Submission) -> None:
        if cmd.request_id in self._parked or self.processor.has_request(cmd.request_id):
            if cmd.accepted.set_running_or_notify_cancel():
                cmd.accepted.set_exception(InvalidRequestError(
                    RequestField.REQUEST_ID,
                    f"request_id {cmd.request_id!r} is already in flight"))
            return
        if cmd.grammar is not None and not cmd.grammar.done():
            self._park(cmd, cmd.grammar)
            return
        # A caller that gave up before the loop got here (its future was
        # cancelled) will read nothing: the request must not run. Once the
        # future is running it can no longer be cancelled, so resolving it
        # below cannot fail whatever the caller does meanwhile.
        if not cmd.accepted.set_running_or_notify_cancel():
            return
        try:
            grammar = self._grammar_of(cmd)
        except Exception as exc:
            cmd.accepted.set_exception(exc)
            return
        child_ids = self.processor.add_request(cmd.request_id, cmd.prompt, cmd.prompt_token_ids,
                                               cmd.params)
        added: list[str] = []
        try:
            for request in cmd.make_requests(child_ids):
                request.grammar = grammar
                self.core.add_request(request)
                added.append(request.request_id)
        except Exception as exc:
            self.core.abort_requests(added)
            self.processor.abort(cmd.request_id)
            cmd.accepted.set_exception(exc)
            return
        self._callbacks[cmd.request_id] = cmd.callback
        self._recorder.num_prompt_tokens += len(cmd.prompt_token_ids) * len(added)
        if cmd.final_only:
            self._final_only.add(cmd.request_id)
        # Published before the caller learns of the acceptance, so admission
        # (which reads stats) never misses an accepted request.
        self.stats = self._recorder.read()
        cmd.accepted.set_result(None)

    def _abort(self, request_id: str) -> None:
        parked = self._parked.pop(request_id, None)
        if parked is not None:
            parked.accepted.cancel()
            return
        output = self.processor.output_of(request_id)
        child_ids = self.processor.abort(request_id)
        if child_ids:
            self.core.abort_requests(child_ids)
        if output is not None:
            self._notify_finished(output, True)
        self._callbacks.pop(request_id, None)
        self._final_only.discard(request_id)

    def _step(self) -> None:
        began = time.perf_counter()
        if self._kv_log is not None:
            self.kv_events.prepare(self._kv_log)
        outputs = self.core.step()
        if self._kv_log is not None:
            self.kv_events.publish(self._kv_log)
        self._recorder.step_done(time.perf_counter() - began, sum(
            len(o.new_token_ids) for c in outputs.values() for o in c.outputs))
        ready: list[tuple[OutputCallback, RequestOutput | RequestDelta]] = []
        for client_outputs in outputs.values():
            processed = self.processor.process(client_outputs.outputs)
            if processed.stopped_by_string:
                self.core.abort_requests(processed.stopped_by_string,
                                         EngineRequestStatus.FINISHED_STOPPED)
            for request_output, delta in zip(processed.request_outputs, processed.deltas,
                                             strict=True):
                rid = request_output.request_id
                callback = self._callbacks.get(rid)
                final_only = rid in self._final_only
                if request_output.finished:
                    self._callbacks.pop(rid, None)
                    self._final_only.discard(rid)
                    self._notify_finished(request_output, False)
                elif final_only:
                    continue
                if callback is not None:
                    ready.append((callback, snapshot(request_output) if final_only else delta))
        # Published before the outputs go out: a caller that got its last
        # output sees stats that count it (pages freed, tokens counted).
        self.stats = self._recorder.read()
        for callback, item in ready:
            self._deliver(callback, item)

    @staticmethod
    def _deliver(callback: OutputCallback,
                 item: RequestOutput | RequestDelta | EngineDeadError) -> None:
        try:
            callback(item)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("output callback failed")

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._fail_lock:  # the loop thread, or _force_fail's timer
            self._fail_all_locked(error)

    def _fail_all_locked(self, error: EngineDeadError) -> None:
        callbacks, self._callbacks = self._callbacks, {}
        self._final_only.clear()
        for request_id, callback in callbacks.items():
            self.processor.abort(request_id)
            self._deliver(callback, error)
        parked, self._parked = list(self._parked.values()), {}
        for cmd in parked:
            if cmd.accepted.set_running_or_notify_cancel():
                cmd.accepted.set_exception(error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            pending = command.submissions if isinstance(command, _SubmitAll) else ()
            for submission in pending:
                if submission.accepted.set_running_or_notify_cancel():
                    submission.accepted.set_exception(error)
