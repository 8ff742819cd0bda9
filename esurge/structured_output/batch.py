"""The grammar matchers of the runner's running requests, and their step masks.

Keyed by request id rather than batch row, so condensing the batch moves
nothing. A step's masks are filled on the host in one call (llguidance's
executor spreads rows over threads, where the model step does not itself
run on the host's cores) into a [rows, words] int32 array that the sampler
unpacks on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import llguidance.numpy
import numpy as np

from esurge.structured_output.compiler import CompiledGrammar
from esurge.structured_output.matcher import GrammarMatcher, mask_words

__all__ = ["GrammarBatch"]

# Below this many rows threads cost more than they save.
_PARALLEL_ROWS = 4


class GrammarBatch:
    """Matchers of the constrained requests among the running ones."""

    def __init__(self, vocab_size: int, *, threaded: bool = True) -> None:
        """threaded: fill many rows on llguidance's threads; leave it off where the
        model step itself runs on every core (JAX's CPU backend): there the
        threads only contend with it (16 rows under load on 2 cores: p50
        1.52 ms threaded against 0.70 ms on the calling thread)."""
        self.vocab_size = vocab_size
        self.threaded = threaded
        self.words = mask_words(vocab_size)
        self._matchers: dict[str, GrammarMatcher] = {}
        self._executor: llguidance.LLExecutor | None = None
        self._all_allowed: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._matchers)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._matchers

    def get(self, req_id: str) -> GrammarMatcher | None:
        """The request's matcher, None when it is unconstrained."""
        return self._matchers.get(req_id)

    def add(self, req_id: str, grammar: CompiledGrammar, stop_ids: Sequence[int],
            output_token_ids: Sequence[int]) -> None:
        """Start following a request; a resumed one replays the output it already has."""
        matcher = GrammarMatcher(grammar, stop_ids)
        matcher.advance(0, list(output_token_ids))
        self._matchers[req_id] = matcher

    def remove(self, req_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests."""
        for req_id in req_ids:
            self._matchers.pop(req_id, None)

    def all_allowed(self, rows: int) -> np.ndarray:
        """[rows, words] int32 masks allowing every token (shared, read-only)."""
        mask = self._all_allowed.get(rows)
        if mask is None:
            mask = np.full((rows, self.words), -1, np.int32)
            mask.flags.writeable = False
            self._all_allowed[rows] = mask
        return mask

    def any_in(self, req_ids: Sequence[str]) -> bool:
        """True when a request of the list is constrained."""
        return bool(self._matchers) and any(r in self._matchers for r in req_ids)

    def advance(self, req_id: str, start: int, tokens: Sequence[int]) -> None:
        """Feed output tokens at output indices [start, ...) to a request's matcher."""
        matcher = self._matchers.get(req_id)
        if matcher is not None:
            matcher.advance(start, tokens)

    def valid_drafts(self, req_id: str, drafts: list[int]) -> list[int]:
        """A proposal cut before the first token the request's grammar refuses."""
        matcher = self._matchers.get(req_id)
        if matcher is None or not drafts:
            return drafts
        return drafts[:matcher.valid_prefix(drafts)]

    def masks(self, req_ids: Sequence[str], samples: np.ndarray,  # [n] bool
              bucket: int) -> np.ndarray:
        """[bucket, words] int32: row i is request i's mask where it samples, else all set."""
        out = np.full((bucket, self.words), -1, np.int32)
        live = [(m, i) for i, rid in enumerate(req_ids)
                if samples[i] and (m := self._matchers.get(rid)) is not None and m.live]
        if len(live) < _PARALLEL_ROWS or not self.threaded:
            for matcher, i in live:
                matcher.fill(out[i])
            return out
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m.llmatcher, i) for m, i in live], out)
        for matcher, i in live:
            matcher.fix_stops(out[i])
        return out

    def prefix_masks(self, req_ids: Sequence[str], prefixes: Sequence[list[int] | None],
                     bucket: int) -> tuple[np.ndarray, list[bool]]:
        """([bucket, words] int32, ok per request): each request's mask after its
        drafts so far (None: not drafting; unconstrained: all set); ok is False
        where the grammar refuses those drafts."""
        out = np.full((bucket, self.words), -1, np.int32)
        ok = [prefix is not None for prefix in prefixes]
        for i, (rid, prefix) in enumerate(zip(req_ids, prefixes, strict=True)):
            matcher = self._matchers.get(rid)
            if prefix is not None and matcher is not None:
                ok[i] = matcher.fill_after(out[i], prefix)
        return out, ok

    def draft_masks(self, req_ids: Sequence[str], samples: np.ndarray,  # [n] bool
                    drafts: np.ndarray,  # [bucket, k] int32
                    num_drafts: np.ndarray,  # [bucket] int32
                    ) -> np.ndarray:
        """[bucket * (k + 1), words] int32: per request, the masks after each
        prefix of its drafts (see GrammarMatcher.fill_with_drafts)."""
        bucket, k = drafts.shape
        out = np.full((bucket, k + 1, self.words), -1, np.int32)
        for i, rid in enumerate(req_ids):
            matcher = self._matchers.get(rid)
            if samples[i] and matcher is not None:
                matcher.fill_with_drafts(out[i], drafts[i, :int(num_drafts[i])].tolist())
        return out.reshape(bucket * (k + 1), self.words)
