"""Incremental detokenization with stop-string detection.

Text is produced with `tokenizers`' streaming decoder, one token at a time,
never by re-decoding the whole output. While stop strings are set, the last
(longest stop string - 1) characters are held back so that no text of a stop
string reaches the client when it must not be included.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens fed to the stream first, so the first output token decodes
# with the right context (leading spaces, merged bytes).
_PROMPT_CONTEXT = 8


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas; finds stop strings.

    Work per token is independent of how much text came before: only the
    text not yet returned and the last (longest stop - 1) returned
    characters are kept for the stop-string search.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._longest = max(map(len, stop)) if stop else 0
        self._include_stop = include_stop_str_in_output
        self._hold = 0 if include_stop_str_in_output or not stop else self._longest - 1
        self._sent: list[str] = []  # the text returned so far, in pieces
        self._tail = ""  # the last (longest - 1) characters returned
        self._unsent = ""  # produced, not returned yet (held back for stop strings)
        self.stop_string: str | None = None
        # Tokens of the last update() up to and including the one that completed
        # a stop string (all of them when none did): the caller drops the rest.
        self.consumed = 0

    @property
    def text(self) -> str:
        """All text so far (truncated at a stop string once found)."""
        return "".join(self._sent) + self._unsent

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Feed tokens; return the text delta that is safe to show now."""
        self.consumed = 0
        if self.stop_string is None:
            for token_id in new_token_ids:
                self.consumed += 1
                chunk = self._stream.step(self._tokenizer, token_id)
                if chunk and self._add(chunk):
                    break
        done = finished or self.stop_string is not None
        cut = len(self._unsent) if done else max(0, len(self._unsent) - self._hold)
        delta, self._unsent = self._unsent[:cut], self._unsent[cut:]
        if delta:
            self._sent.append(delta)
            if self._longest > 1:
                self._tail = (self._tail + delta)[-(self._longest - 1):]
        return delta

    def _add(self, chunk: str) -> bool:
        """Append a decoded chunk; True when it completed a stop string."""
        start = len(self._tail) + len(self._unsent)
        self._unsent += chunk
        if not self._stop:
            return False
        window = self._tail + self._unsent
        search_from = max(0, start - self._longest + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = window.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.stop_string = stop
        # Held-back text means a stop string never starts in text already returned.
        end = at + len(stop) if self._include_stop else at
        self._unsent = window[len(self._tail):max(end, len(self._tail))]
        return True
