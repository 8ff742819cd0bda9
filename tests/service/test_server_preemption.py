"""A page budget that forces preemption: PREEMPTED reaches the Generate streams.

The shared server has 127 usable pages of 8 tokens; four requests growing
to 388 tokens need 49 pages each (196 in all), so running together some
must be preempted (their pages freed, recomputed later).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NEW_TOKENS = 380
QUEUED = engine_pb2.ENGINE_CORE_EVENT_TYPE_QUEUED
SCHEDULED = engine_pb2.ENGINE_CORE_EVENT_TYPE_SCHEDULED
PREEMPTED = engine_pb2.ENGINE_CORE_EVENT_TYPE_PREEMPTED


async def _stream(client: Any, i: int) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    call = client.generate([7 + i, 8, 9, 10, 11, 12, 13, 14], params, return_events=True)
    events: list[int] = []
    tokens = 0
    while (message := await call.read()) is not grpc.aio.EOF:
        events.extend(e.type for e in message.events)
        tokens += len(message.token_ids)
    return events, tokens


def test_preempted_events_reach_the_streams(live_server: Any, client: Any) -> None:
    from service.client import AsyncEngineClient

    before = live_server.engine.stats.num_preemptions

    async def run() -> list[tuple[list[int], int]]:
        async with AsyncEngineClient(live_server.target, timeout=240) as aclient:
            return await asyncio.gather(*(_stream(aclient, i) for i in range(4)))

    results = asyncio.run(run())
    preemptions = live_server.wait_idle(timeout=30) and (
        live_server.engine.stats.num_preemptions - before)
    assert preemptions > 0
    assert [tokens for _, tokens in results] == [NEW_TOKENS] * 4
    for events, _ in results:
        assert events[:2] == [QUEUED, SCHEDULED]
    seen = sum(events.count(PREEMPTED) for events, _ in results)
    assert seen == preemptions  # every preemption reached its stream
    for events, _ in results:  # each preemption is followed by a new scheduling
        for at, kind in enumerate(events):
            if kind == PREEMPTED:
                assert SCHEDULED in events[at + 1:]
