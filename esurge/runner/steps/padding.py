"""Steps of no real request, in a given bucket: what warm-up runs to compile each shape."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from esurge.models.batch import ForwardBatch, tile_layout
from esurge.models.kv_cache import NULL_PAGE
from esurge.runner.step_inputs import StepInputs, query_tiles_for_bucket

if TYPE_CHECKING:
    from esurge.runner.runner import eSurgeRunner

__all__ = ["padding_batch", "padding_inputs", "with_tiles"]


def padding_batch(runner: eSurgeRunner, tokens: int, requests: int,
                  num_spec: int = 0, tile: int = 1) -> ForwardBatch:
    """A ForwardBatch of padding only, every slot writing to the null page."""
    groups = len(runner.cache_groups.groups)
    max_pages = runner.input_batch.page_tables.shape[2]
    tile_rows, row_in_tiles = (tile_layout(np.zeros(0, np.int64), tokens, requests, tile)
                               if tile > 1 else (None, None))
    return ForwardBatch(
        input_ids=np.zeros(tokens, np.int32), positions=np.zeros(tokens, np.int32),
        token_req=np.zeros(tokens, np.int32),
        slot_mapping=np.full((groups, tokens), NULL_PAGE * runner.page_size, np.int32),
        page_tables=np.full((groups, requests, max_pages), NULL_PAGE, np.int32),
        query_start_loc=np.zeros(requests + 1, np.int32),
        seq_lens=np.zeros(requests, np.int32),
        logits_indices=np.zeros(requests * (1 + num_spec), np.int32),
        query_tile=tile, tile_rows=tile_rows, row_in_tiles=row_in_tiles,
    )


def padding_inputs(runner: eSurgeRunner, tokens: int, requests: int, tile: int = 1
                   ) -> StepInputs:
    """A step of no real request in the (tokens, requests) bucket."""
    none = np.zeros(0, np.int64)
    return StepInputs(
        batch=padding_batch(runner, tokens, requests, runner.num_spec, tile), req_ids=[],
        rows=none,
        samples=np.zeros(0, bool), sample_positions=np.zeros(0, np.int32),
        seq_lens=np.zeros(0, np.int32), prev_index=np.full(tokens, -1, np.int32), num_tokens=0,
        num_reqs_bucket=requests, num_drafts=np.zeros(0, np.int32), num_spec=runner.num_spec)


def with_tiles(shapes: list[tuple[int, int]], tiled: bool) -> list[tuple[int, int, int]]:
    """Each (tokens, requests) bucket with every query tile its steps can use."""
    return [(t, r, tile) for t, r in shapes for tile in query_tiles_for_bucket(t, tiled)]
