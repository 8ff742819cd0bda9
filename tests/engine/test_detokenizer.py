"""Incremental detokenization: same text as a full decode, stop strings honoured."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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


# ---- property: deltas and stops as a whole-text reference finds them -----------

PIECES = ["def ", "grüße", "(x)", ":\n", "    ", "return ", "'naïve", " — ", "日本語", " ✓'",
          " + ", "str", "# end", "\n", "aa", "ab", "ba", "STOP"]


def _texts_by_token(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    """The text after each token, by decoding the whole prefix in one go."""
    context = prompt[-8:]
    base = tok.decode(context, skip_special_tokens=True)
    return [tok.decode(context + ids[:k], skip_special_tokens=True)[len(base):]
            for k in range(1, len(ids) + 1)]


def _reference(texts: list[str], stops: tuple[str, ...], include: bool
               ) -> tuple[str, str | None, int]:
    """(text, stop string, tokens consumed): the first token after which a stop
    string occurs ends the output there, at the earliest such occurrence (the
    first listed of those starting there: vLLM's order)."""
    for k, text in enumerate(texts, 1):
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            at, stop = min(found, key=lambda f: f[0])
            return text[:at + len(stop) if include else at], stop, k
    return (texts[-1] if texts else ""), None, len(texts)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_and_stops_agree_with_a_whole_text_reference(tok: Tokenizer,
                                                            data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=12)))
    ids = tok.encode(text).ids
    prompt = tok.encode(data.draw(st.sampled_from(["", "x = 1\n", "naïve "]))).ids
    texts = _texts_by_token(tok, prompt, ids)
    whole = texts[-1] if texts else ""
    # Stop strings that occur (substrings of the output) and ones that may not.
    found = st.builds(lambda i, n: whole[i:i + n], st.integers(0, max(len(whole) - 1, 0)),
                      st.integers(1, 6)).filter(bool) if whole else st.nothing()
    stops = tuple(data.draw(st.lists(found | st.sampled_from(["STOP", "a", "ü", "—", "zz"]),
                                     max_size=3, unique=True)))
    include = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, prompt, stop=stops, include_stop_str_in_output=include)
    # Tokens in groups of 1-4, as decode bursts deliver them.
    out, fed, consumed = "", 0, 0
    while fed < len(ids) and detok.stop_string is None:
        n = data.draw(st.integers(1, 4))
        out += detok.update(ids[fed:fed + n])
        consumed, fed = fed + detok.consumed, fed + n
    out += detok.update([], finished=True)
    expected, stop, tokens = _reference(texts, stops, include)
    assert (out, detok.stop_string) == (expected, stop), (text, stops, include)
    assert detok.text == expected
    if stop is not None:
        assert consumed == tokens
