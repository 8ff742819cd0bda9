"""Ending requests early: Abort RPC, client cancel, deadline. Pages come back at once.

"At once" is checked against the engine's step counter: a request of N
tokens needs N engine steps, so the engine being idle after far fewer steps
means it was stopped, not left to finish.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG = 500  # tokens: a request this long needs at least LONG engine steps


def long_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)


def assert_freed(live_server: Any, steps_at_start: int) -> None:
    load = live_server.wait_idle(timeout=10)
    steps = live_server.engine.loop.num_steps - steps_at_start
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
    assert load.kv_cache_usage == 0.0
    assert load.num_free_pages == live_server.engine.runner.num_pages - 1
    assert steps < LONG, f"the request ran {steps} steps: it was not stopped"


DEADLINE = 3.0  # seconds; the engine is held still while it passes


@contextlib.contextmanager
def engine_held(live_server: Any) -> Iterator[None]:
    """Hold the engine still: a request of its own whose output callback (run on
    the engine thread) blocks until the block exits, so no request can make
    progress, however fast the machine, while a deadline passes."""
    engine = live_server.engine
    holding, release = threading.Event(), threading.Event()

    def hold(item: Any) -> None:
        holding.set()
        release.wait(60)

    rid = engine.submit([3], SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True),
                        hold, request_id="holder")
    assert holding.wait(60)
    try:
        yield
    finally:
        release.set()
        engine.abort(rid)


def wait_running(live_server: Any, count: int) -> None:
    """Until the engine's published stats show `count` requests running."""
    for _ in range(6000):
        if live_server.engine.stats.num_running >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"{count} requests never ran")


def test_abort_rpc_ends_the_stream_and_frees_pages(live_server: Any, client: Any) -> None:
    start = live_server.engine.loop.num_steps
    stream = client.generate([5, 6, 7, 8], long_params(), request_id="abort-me")
    first = next(stream)
    assert first.request_id == "abort-me"
    assert client.load().num_running_requests == 1
    assert client.abort(["abort-me", "never-existed"]) == ["abort-me"]
    rest = list(stream)  # the stream ends normally, with an ABORT message
    assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT
    got = len(first.token_ids) + sum(len(m.token_ids) for m in rest)
    assert rest[-1].usage.completion_tokens == got < LONG
    assert_freed(live_server, start)
    assert client.abort(["abort-me"]) == []  # idempotent


def test_client_cancel_aborts_in_the_engine(live_server: Any, client: Any) -> None:
    start = live_server.engine.loop.num_steps
    stream = client.generate([9, 10, 11], long_params(), request_id="cancel-me")
    next(stream)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert_freed(live_server, start)
    assert not live_server.engine.loop.processor.has_request("cancel-me")


def test_deadline_exceeded_aborts_in_the_engine(live_server: Any, client: Any) -> None:
    start = live_server.engine.loop.num_steps
    errors: list[grpc.RpcError] = []

    def call() -> None:
        try:
            client.generate_unary([12, 13, 14], long_params(), timeout=DEADLINE,
                                  request_id="slow")
        except grpc.RpcError as err:
            errors.append(err)

    caller = threading.Thread(target=call)
    caller.start()
    wait_running(live_server, 1)  # it runs; then the engine is held past its deadline
    with engine_held(live_server):
        caller.join(30)
    assert not caller.is_alive()
    [error] = errors
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_freed(live_server, start)
    assert not live_server.engine.loop.processor.has_request("slow")


def test_deadline_on_a_stream(live_server: Any, client: Any) -> None:
    start = live_server.engine.loop.num_steps
    stream = client.generate([15, 16], long_params(), timeout=DEADLINE)
    received = len(next(stream).token_ids)  # it runs; then the engine is held
    with engine_held(live_server), pytest.raises(grpc.RpcError) as info:
        for message in stream:
            received += len(message.token_ids)
    assert 0 < received < LONG  # it was running when the deadline passed
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_freed(live_server, start)
