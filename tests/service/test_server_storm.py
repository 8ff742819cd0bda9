"""A storm of streams ended early at random points leaves the server as it was.

A third of the streams are cancelled by the client or given a 1-50 ms
deadline (so some end while the engine is still accepting their request,
some while they run), a third are aborted by the Abort RPC, a third run to
the end. Afterwards the server is SERVING, every page is back, nothing runs
or waits, and a greedy request gives the same tokens as before.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import grpc
import pytest

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_STREAMS = 200
CONCURRENCY = 24  # below the server's queue limit, so no call is refused for overload
STORM_SECONDS = 120.0
ENDED_EARLY = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 24), ignore_eos=True)


async def _drain(call: Any) -> list[Any]:
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def _cancelled(client: Any, rng: random.Random, i: int) -> grpc.StatusCode:
    prompt = [5 + i % 50, 6, 7]
    if rng.random() < 0.5:
        call = client.generate(prompt, _params(rng), timeout=rng.uniform(0.001, 0.05))
    else:
        call = client.generate(prompt, _params(rng))
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        call.cancel()
    try:
        await _drain(call)
    except asyncio.CancelledError:
        return grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def _aborted(client: Any, rng: random.Random, i: int) -> grpc.StatusCode:
    request_id = f"storm-abort-{i}"
    call = client.generate([9, 10 + i % 50], _params(rng), request_id=request_id)
    if rng.random() < 0.5:
        await call.read()  # the prompt / first-token message: it is running
    else:
        await asyncio.sleep(rng.uniform(0.0, 0.02))
    await client.abort([request_id])
    try:
        rest = await _drain(call)
    except grpc.aio.AioRpcError as err:
        return err.code()
    finish = [m.finish_reason for m in rest if m.finish_reason]
    assert finish in ([], [engine_pb2.FINISH_REASON_ABORT], [engine_pb2.FINISH_REASON_LENGTH])
    return grpc.StatusCode.OK


async def _completed(client: Any, rng: random.Random, i: int) -> grpc.StatusCode:
    params = _params(rng)
    messages = await _drain(client.generate([11, 12, i % 50 + 3], params))
    assert sum(len(m.token_ids) for m in messages) == params.max_tokens
    return grpc.StatusCode.OK


async def _storm(target: str, seed: int) -> list[tuple[str, grpc.StatusCode]]:
    from service.client import AsyncEngineClient

    rng = random.Random(seed)
    kinds = {"cancel": _cancelled, "abort": _aborted, "complete": _completed}
    plan = [list(kinds)[i % 3] for i in range(NUM_STREAMS)]
    rng.shuffle(plan)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with AsyncEngineClient(target, timeout=60) as client:

        async def one(i: int, kind: str) -> tuple[str, grpc.StatusCode]:
            async with gate:
                return kind, await kinds[kind](client, random.Random(seed * 1000 + i), i)

        return await asyncio.wait_for(
            asyncio.gather(*(one(i, kind) for i, kind in enumerate(plan))), STORM_SECONDS)


def test_storm_of_early_ends_leaves_the_server_intact(live_server: Any, client: Any) -> None:
    probe = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = list(client.generate_unary([3, 4, 5, 6], probe).completions[0].token_ids)
    began = time.monotonic()
    outcomes = asyncio.run(_storm(live_server.target, seed=20))
    assert time.monotonic() - began < STORM_SECONDS
    assert len(outcomes) == NUM_STREAMS
    for kind, code in outcomes:
        allowed = ENDED_EARLY | {grpc.StatusCode.OK} if kind == "cancel" else {
            grpc.StatusCode.OK}
        assert code in allowed, (kind, code)
    assert client.health() == "SERVING"
    load = live_server.wait_idle(timeout=30)
    assert (load.num_running_requests, load.num_waiting_requests) == (0, 0)
    assert load.num_free_pages == live_server.engine.runner.num_pages - 1
    assert load.kv_cache_usage == 0.0
    after = list(client.generate_unary([3, 4, 5, 6], probe).completions[0].token_ids)
    assert after == before
