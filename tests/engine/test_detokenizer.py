"""Incremental detokenization: same text as a full decode, stop strings honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from esurge.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))


TEXT = "def grüße(x):\n    return 'naïve — 日本語 ✓' + str(x)  # end\n"


def stream_all(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.update([t]) for t in ids]


def test_streaming_matches_full_decode_across_multibyte(tok: Tokenizer) -> None:
    prompt = tok.encode("x = 1\n").ids
    ids = tok.encode(TEXT).ids
    assert len(ids) > len(TEXT) // 4  # multi-byte characters really are split
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream_all(detok, ids)
    assert "".join(deltas) == TEXT == tok.decode(ids)
    # Some token completes only part of a character and yields nothing yet.
    assert "" in deltas


def test_stop_string_truncates_and_holds_back(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta STOP gamma").ids
    detok = IncrementalDetokenizer(tok, [], stop=("STOP", "never"))
    out = ""
    for t in ids:
        out += detok.update([t])
        if detok.stop_string is not None:
            break
    assert detok.stop_string == "STOP"
    assert out == "alpha beta " == detok.text


def test_stop_string_included_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta STOP gamma").ids
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",), include_stop_str_in_output=True)
    out = "".join(detok.update([t]) for t in ids)
    assert out == "alpha beta STOP" and detok.stop_string == "STOP"


def test_held_text_released_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("tail ST").ids
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    streamed = "".join(detok.update([t]) for t in ids)
    assert streamed == "tail"  # " ST" could still become "STOP"
    assert detok.update([], finished=True) == " ST"
    assert detok.stop_string is None
