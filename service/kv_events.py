"""The prefix cache's events as vLLM-protocol `KvEventBatch`es (smg's form).

A page is a block: its 128-bit content hash is folded to the protocol's
signed 64-bit `block_hash` (the low 8 bytes), its token ids and size go with
it, the parent's hash chains it. Every batch carries the engine's load, and
an idle stream sends a load-only heartbeat, as the protocol asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from smg_grpc_proto.generated import common_pb2

from esurge.core.kv_events import KVEvent, PagesCleared, PagesRemoved, PagesStored
from esurge.core.page_hash import PageHash
from esurge.engine.kv_event_feed import KVEventBatch
from esurge.engine.stats import EngineStats

if TYPE_CHECKING:
    from esurge.engine.api import eSurge

__all__ = ["block_hash", "kv_event_stream"]

_POLL_S = 0.05
_HEARTBEAT_S = 1.0


def block_hash(page_hash: PageHash) -> int:
    """The protocol's int64 id of a page hash."""
    return int.from_bytes(page_hash[:8], "little", signed=True)


def _event(event: KVEvent, event_id: int) -> common_pb2.KvCacheEvent:
    if isinstance(event, PagesStored):
        stored = common_pb2.KvBlocksStored(
            blocks=[common_pb2.KvBlock(block_hash=block_hash(h), token_ids=tokens,
                                       block_size=event.page_size)
                    for h, tokens in zip(event.hashes, event.token_ids, strict=True)],
            tier=common_pb2.KV_CACHE_TIER_DEVICE, locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
            group_idx=event.group)
        if event.parent is not None:
            stored.parent_block_hash = block_hash(event.parent)
        if event.cache_salt is not None:
            stored.cache_salt = event.cache_salt
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, PagesRemoved):
        return common_pb2.KvCacheEvent(event_id=event_id, removed=common_pb2.KvBlocksRemoved(
            block_hashes=[block_hash(h) for h in event.hashes], group_idx=event.group,
            tier=common_pb2.KV_CACHE_TIER_DEVICE))
    if isinstance(event, PagesCleared):
        return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())
    raise TypeError(f"not a KV cache event: {event!r}")


def _load(stats: EngineStats, max_running: int, sample: int,
          load_only: bool) -> common_pb2.EngineLoad:
    return common_pb2.EngineLoad(
        running_requests=stats.num_running, waiting_requests=stats.num_waiting,
        token_usage=stats.kv_cache_usage, max_running_requests=max_running, sample=sample,
        load_only=load_only)


def _batch(batch: KVEventBatch, stats: EngineStats, max_running: int
           ) -> common_pb2.KvEventBatch:
    first_id = batch.sequence * 1_000_000  # ids unique across batches
    return common_pb2.KvEventBatch(
        sequence_number=batch.sequence, timestamp=batch.timestamp, dp_rank=0,
        events=[_event(e, first_id + i) for i, e in enumerate(batch.events)],
        load=_load(stats, max_running, batch.sequence, False))


async def kv_event_stream(engine: eSurge, start_after: int, load_first: bool
                          ) -> AsyncIterator[common_pb2.KvEventBatch]:
    """Batches after `start_after` as they come, with heartbeats while idle."""
    feed = engine.loop.kv_events
    feed.subscribe()
    max_running = engine.config.scheduler_config.max_num_seqs
    cursor, sample, quiet = start_after, 0, 0.0
    if load_first:
        yield common_pb2.KvEventBatch(sequence_number=0, load=_load(
            engine.stats, max_running, sample, True))
    while True:
        batches = feed.after(cursor)
        for batch in batches:
            yield _batch(batch, engine.stats, max_running)
            cursor = batch.sequence
        quiet = 0.0 if batches else quiet + _POLL_S
        if quiet >= _HEARTBEAT_S:
            sample, quiet = sample + 1, 0.0
            yield common_pb2.KvEventBatch(sequence_number=cursor, load=_load(
                engine.stats, max_running, sample, True))
        await asyncio.sleep(_POLL_S)
