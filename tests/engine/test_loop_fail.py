"""EngineLoop.fail: an outside failure (a multi-host follower left) ends the engine,
even when its thread is stuck inside a step."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from esurge.engine.core import EngineCore
from esurge.engine.loop import EngineDeadError, EngineLoop
from esurge.engine.output_processor import OutputProcessor
from esurge.engine.stats import StatsRecorder
from esurge.outputs import ModelRunnerOutput
from esurge.sampling_params import SamplingParams
from esurge.scheduler.output import SchedulerOutput
from tests.scheduler.fakes import FakeRunner, make_request, make_scheduler


class StuckRunner(FakeRunner):
    """Runs like FakeRunner for 3 steps; its 4th collect waits until released
    (as a collective waits for a host that died)."""

    blocked = threading.Event()
    released = threading.Event()

    def dispatch(self, out: SchedulerOutput) -> SchedulerOutput:
        return out

    def collect(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.steps == 3:
            self.blocked.set()
            self.released.wait()
        return self.execute(out)


def _loop(runner: FakeRunner) -> EngineLoop:
    scheduler = make_scheduler()
    loop = EngineLoop(EngineCore(scheduler, runner), OutputProcessor(None),
                      StatsRecorder(scheduler, lambda: None))
    loop.start()
    return loop


def _submit(loop: EngineLoop, rid: str, got: list[object]) -> Future[None]:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    return loop.submit(rid, None, [1, 2, 3], params,
                       lambda ids: [make_request(i, [1, 2, 3], 50) for i in ids],
                       got.append)


def test_fail_ends_an_idle_loop_at_once() -> None:
    loop = _loop(FakeRunner(page_size=8))
    loop.fail(RuntimeError("host 1 left the job"), grace_s=60)
    deadline = time.monotonic() + 5
    while loop.alive:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "host 1 left the job" in str(loop.error)


def test_fail_fails_the_requests_of_a_loop_stuck_in_a_step() -> None:
    runner = StuckRunner(page_size=8)
    loop = _loop(runner)
    got: list[object] = []
    _submit(loop, "r", got).result(5)
    assert runner.blocked.wait(5)  # the loop is inside a collect that does not return
    assert got and not isinstance(got[-1], EngineDeadError)
    start = time.monotonic()
    loop.fail(RuntimeError("host 1 left the job"), grace_s=0.5)
    while not isinstance(got[-1], EngineDeadError):
        assert time.monotonic() - start < 5
        time.sleep(0.01)
    assert not loop.alive and "host 1 left the job" in str(got[-1])
    late: list[object] = []
    assert isinstance(_submit(loop, "late", late).exception(5), EngineDeadError)
    runner.released.set()
    loop.shutdown(5)
