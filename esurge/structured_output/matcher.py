"""The grammar state of one running request, and its token masks.

A `GrammarMatcher` follows a request's output token by token and says which
tokens may come next, as a packed bitmask (bit t of word t // 32 set: token
t allowed; llguidance's layout). The request's own stop tokens take the
place of llguidance's end-of-sequence tokens: they are allowed exactly where
the grammar accepts, and sampling one ends the constrained output.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import llguidance
import numpy as np

from esurge.structured_output.compiler import CompiledGrammar

__all__ = ["GrammarMatcher", "mask_words"]

log = logging.getLogger(__name__)


def mask_words(vocab_size: int) -> int:
    """int32 words in one packed mask row."""
    return (vocab_size + 31) // 32


def _set_bits(row: np.ndarray, tokens: Iterable[int], value: bool) -> None:
    # row: [W] int32, viewed as uint32 so bit 31 needs no sign juggling.
    words = row.view(np.uint32)
    for t in tokens:
        bit = np.uint32(1 << (t & 31))
        words[t >> 5] = (words[t >> 5] | bit) if value else (words[t >> 5] & ~bit)


class GrammarMatcher:
    """llguidance's matcher for one request, fed with its output tokens.

    num_consumed counts the output tokens seen so far (a stop token included);
    tokens are fed by output index, so a token seen twice (collected after an
    early read for the next step's mask) is consumed once.
    """

    def __init__(self, grammar: CompiledGrammar, stop_ids: Sequence[int]) -> None:
        self._matcher = grammar.new_matcher()
        self._engine_eos = tuple(grammar.tokenizer.eos_tokens)
        self.stop_ids = tuple(stop_ids)
        self.num_consumed = 0
        self.ended = False  # a stop token was sampled where the grammar accepts

    @property
    def error(self) -> str | None:
        """llguidance's message once a token it refused was fed, else None."""
        return self._matcher.get_error() or None if self._matcher.is_error() else None

    def advance(self, start: int, tokens: Sequence[int]) -> None:
        """Feed the output tokens at output indices [start, start + len)."""
        if start > self.num_consumed:
            raise ValueError(f"grammar matcher fed output index {start} after only "
                             f"{self.num_consumed} tokens")
        for token in tokens[self.num_consumed - start:]:
            self.num_consumed += 1
            if self.ended or self._matcher.is_error():
                continue
            if token in self.stop_ids and self._matcher.is_accepting():
                self.ended = True
            elif not self._matcher.consume_token(int(token)):
                log.warning("grammar refused sampled token %d: %s", token, self.error)

    @property
    def live(self) -> bool:
        """True while the grammar still decides the next token."""
        return not self.ended and not self._matcher.is_error()

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher (for a batched mask fill)."""
        return self._matcher

    def fill(self, row: np.ndarray) -> None:
        """Write the mask for the next token into row ([W] int32)."""
        if not self.live:
            row[:] = -1  # the request is ending: the token is never used
            return
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.fix_stops(row)

    def fix_stops(self, row: np.ndarray) -> None:
        """Swap llguidance's end tokens in a filled row for the request's stop tokens."""
        _set_bits(row, self._engine_eos, False)
        if self._matcher.is_accepting():
            _set_bits(row, self.stop_ids, True)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a draft the grammar allows from here (a
        stop token counts where the grammar accepts, and nothing after it)."""
        if not self.live or not tokens:
            return 0
        n = self._matcher.validate_tokens([int(t) for t in tokens])
        if n < len(tokens) and tokens[n] in self.stop_ids:
            consumed = self._matcher.try_consume_tokens([int(t) for t in tokens[:n]])
            accepting = self._matcher.is_accepting()
            if consumed:
                self._matcher.rollback(consumed)
            n += accepting
        return n

    def fill_after(self, row: np.ndarray, tokens: Sequence[int]) -> bool:
        """Write the mask after `tokens` (drafts not yet verified) into row ([W]
        int32) and leave the state as it was; False, row untouched, when the
        grammar refuses one of them or one is a stop token (nothing is drafted
        past a stop)."""
        if not self.live or any(t in self.stop_ids for t in tokens):
            return False
        consumed = self._matcher.try_consume_tokens([int(t) for t in tokens]) if tokens else 0
        ok = consumed == len(tokens)
        if ok:
            self.fill(row)
        if consumed:
            self._matcher.rollback(consumed)
        return ok

    def fill_with_drafts(self, rows: np.ndarray, drafts: Sequence[int]) -> None:
        """Masks for a draft's positions: rows[j] ([S, W] int32) is the mask after
        drafts[:j]; rows past the first draft the grammar refuses allow all (the
        verifier rejects that draft, so they are never read)."""
        rows[:] = -1
        if self.ended or self._matcher.is_error():
            return
        self.fill(rows[0])
        consumed = 0
        for j, token in enumerate(drafts):
            # try_consume refuses without entering the error state: one call, not two.
            if token in self.stop_ids or self._matcher.try_consume_tokens([int(token)]) != 1:
                break
            consumed += 1
            self.fill(rows[j + 1])
        if consumed:
            self._matcher.rollback(consumed)
