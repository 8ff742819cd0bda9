"""Tokenizing without holding the GIL.

`tokenizers.Tokenizer.encode` and `decode` hold the GIL for their whole run
(about 1 s for a megabyte of text): called from a worker thread they still
stop the event loop and every other Python thread. Their batch forms release
it, so these run one text as a batch of one.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

__all__ = ["decode_ids", "encode_ids"]


def encode_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text`, with the GIL released while the tokenizer runs."""
    [encoding] = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
    return list(encoding.ids)


def decode_ids(tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids`, with the GIL released while the tokenizer runs."""
    [text] = tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)
    return str(text)
