"""Calibration times speculative steps whose requests draft: the draft steps
compute only the rows through the last drafting request, so a timing step of
padding requests (none drafting) would time no draft rows at all."""

from __future__ import annotations

import numpy as np

from esurge.runner.steps.speculative.calibrate import _drafting
from esurge.runner.steps.speculative.decoder import TargetPass
from esurge.spec_decode.proposer import DraftBatch


def _target(bucket: int) -> TargetPass:
    rows = np.zeros(16, np.int32)
    batch = DraftBatch(positions=rows, token_req=rows, slot_mapping=rows,
                       page_tables=np.zeros((bucket, 4), np.int32), num_tokens=np.int32(0),
                       next_ids=rows, next_slot=rows - 1, first_row=np.zeros(bucket, np.int32),
                       propose=np.zeros(bucket, bool),
                       temperature=np.zeros(bucket, np.float32))
    empty = np.zeros(0)
    return TargetPass(logits=empty, hidden=empty, features=empty,  # type: ignore[arg-type]
                      verified=None, draft_batch=batch,  # type: ignore[arg-type]
                      eligible=np.zeros(0, bool))


def test_a_timing_step_drafts_for_its_requests() -> None:
    timed = _drafting(_target(4), 3)
    assert np.asarray(timed.draft_batch.propose).tolist() == [True, True, True, False]
    assert _drafting(_target(16), 16).draft_batch.propose.all()
