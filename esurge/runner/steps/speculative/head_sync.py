"""Where each request's Eagle head cache stops, and when to catch it up.

A plain step leaves the head's cache without the step's tokens, so a request
that took one cannot draft on it. Where drafting pays again at the batch's
size (the batch shrank: the policy takes plain steps at sizes where
speculation loses), such a request is moved back to where its head's cache
stops (Scheduler.rewind) and computes those tokens again in a speculative
step, which passes the target's features of them through the head as it does
a prompt chunk's; it drafts from then on. Computing a token again costs
SmolLM2 on a 2-core CPU about 0.07 of a decode step (a 128-token prompt's
prefill 48.6 ms against 5.0 ms a decode step), which a 1.15x speculation
repays within about 0.55 tokens of output, so a request moves back when at
least as many tokens may still come as it computes again, prompt included
where the prompt did not go through the head. The rows computed again write
their keys and values to the null page (the cache holds them, in pages the
prefix cache may share); the head writes its own at their real slots. A
request with per-token sampling state (it would not draft) does not move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from esurge.runner.input_batch import InputBatch
from esurge.runner.steps.speculative.draft_inputs import allowed_count

__all__ = ["MAX_MOVES", "VERDICT_STEPS", "HeadSync"]

VERDICT_STEPS = 16
MAX_MOVES = 2


@dataclass(slots=True)
class HeadSync:
    """The head's cache end of each request that decoded plain steps."""

    # The position of the first token the head's cache misses, by request.
    head_end: dict[str, int] = field(default_factory=dict)
    # Moved back to head_end and not yet through a speculative step.
    rewound: set[str] = field(default_factory=set)
    # Of those moved back, the position up to which the cache holds their
    # tokens (computed again, their rows write to the null page).
    until: dict[str, int] = field(default_factory=dict)
    # A request whose batch stopped drafting (its slowest request lost: a mix
    # stop) moves back only in a batch smaller than that one; each request
    # moves back at most MAX_MOVES times. Where SmolLM2's prediction at batch
    # 4 sat at the policy's margin, a request moved back there, drafted, was
    # stopped with its batch, and moved back again: 149 moves in 7 sets.
    below: dict[str, int] = field(default_factory=dict)
    moves: dict[str, int] = field(default_factory=dict)
    # Steps collected so far (the runner counts them): the policy's verdict is
    # asked before every step while such requests run (every request that took
    # a plain step is one), and computed once per batch size in VERDICT_STEPS
    # steps (it moves with measured costs and acceptance, slowly).
    collected: int = 0
    # The verdict by (batch size, collected // VERDICT_STEPS): the latest only.
    _verdict: dict[tuple[int, int], bool] = field(default_factory=dict)

    def ran_plain(self, ib: InputBatch, req_ids: Iterable[str], unsynced: set[str]) -> None:
        """A plain step of these requests; adds them to `unsynced`. One drafting
        until now keeps where its cache stops, unless it was moved back for that
        and its step ran plain after all (it would move back again and again)."""
        for req_id in req_ids:
            if req_id in unsynced:
                continue
            unsynced.add(req_id)
            if req_id in self.rewound:
                self.rewound.discard(req_id)
            else:
                self.head_end[req_id] = int(ib.num_computed[ib.row_of[req_id]])

    def ran_speculative(self, req_ids: Iterable[str]) -> None:
        """A speculative step of these requests: those moved back catch the head up."""
        if self.rewound:
            self.rewound.difference_update(req_ids)

    def wanted(self, ib: InputBatch, pays: Callable[[int], bool]) -> dict[str, int]:
        """The requests to move back, to the position where each one's cache
        stops, where drafting pays (`pays`) at the batch's size."""
        batch = len(ib.req_ids)
        key = (batch, self.collected // VERDICT_STEPS)
        pays_here = self._verdict.get(key)
        if pays_here is None:
            pays_here = pays(batch)
            self._verdict = {key: pays_here}
        if not pays_here:
            return {}
        wanted = {}
        for req_id, end in self.head_end.items():
            row = ib.row_of.get(req_id)
            if (row is None or ib.sampling.dense[row] is not None
                    or batch >= self.below.get(req_id, batch + 1)
                    or self.moves.get(req_id, 0) >= MAX_MOVES):
                continue
            span = int(ib.num_computed[row]) - end
            if span > 0 and allowed_count(ib, row, int(ib.num_known[row]), span) == span:
                wanted[req_id] = end
        return wanted

    def moved(self, computed: Mapping[str, int], unsynced: set[str]) -> None:
        """These requests compute again from where their cache stops, up to how
        far each had computed: they draft again after it (removed from
        `unsynced`)."""
        for req_id, end in computed.items():
            unsynced.discard(req_id)
            self.head_end.pop(req_id, None)
            self.below.pop(req_id, None)
            self.rewound.add(req_id)
            self.until[req_id] = end
            self.moves[req_id] = self.moves.get(req_id, 0) + 1

    def batch_stopped(self, ib: InputBatch, req_ids: Iterable[str], batch: int) -> None:
        """These requests' batch of `batch` stopped drafting after a speculative
        step whose tokens the batch now holds: each may move back, in a
        smaller batch, to where that step's tokens end."""
        for req_id in req_ids:
            row = ib.row_of.get(req_id)
            if row is not None:
                self.head_end[req_id] = int(ib.num_known[row]) - 1
                self.below[req_id] = batch

    def recompute(self, ib: InputBatch) -> dict[str, int] | None:
        """The requests still computing tokens again, with the position up to which
        the cache holds them (build_step_inputs' recompute); None when none is."""
        if not self.until:
            return None
        for req_id in [r for r, end in self.until.items()
                       if r not in ib.row_of or ib.num_computed[ib.row_of[r]] >= end]:
            del self.until[req_id]
        return self.until or None

    def stop(self, req_ids: Iterable[str]) -> None:
        """Requests whose drafts were stopped (by the gate: for good)."""
        for req_id in req_ids:
            self.head_end.pop(req_id, None)
            self.below.pop(req_id, None)

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests that left the batch."""
        for req_id in req_ids:
            for kept in (self.head_end, self.until, self.below, self.moves):
                kept.pop(req_id, None)
            self.rewound.discard(req_id)
