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
    """Turns a request's output tokens into text deltas; finds stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold = 0 if include_stop_str_in_output or not stop else max(map(len, stop)) - 1
        self.text = ""  # all text so far (truncated at a stop string once found)
        self._sent = 0  # characters of `text` already returned
        self.stop_string: str | None = None
        # Tokens of the last update() up to and including the one that completed
        # a stop string (all of them when none did): the caller drops the rest.
        self.consumed = 0

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Feed tokens; return the text delta that is safe to show now."""
        self.consumed = 0
        if self.stop_string is None:
            for token_id in new_token_ids:
                self.consumed += 1
                chunk = self._stream.step(self._tokenizer, token_id)
                if chunk:
                    start = len(self.text)
                    self.text += chunk
                    if self._check_stop(start):
                        break
        done = finished or self.stop_string is not None
        end = len(self.text) if done else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta

    def _check_stop(self, new_from: int) -> bool:
        if not self._stop:
            return False
        longest = max(map(len, self._stop))
        search_from = max(0, new_from - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.stop_string = stop
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return True
