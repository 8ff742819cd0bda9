"""The host side of constrained decoding: compiler cache, matcher masks and drafts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from esurge.errors import InvalidRequestError
from esurge.structured_output.batch import GrammarBatch
from esurge.structured_output.compiler import GrammarCompiler
from esurge.structured_output.params import StructuredOutputsParams

VOCAB, EOS, STOP = 512, 2, 7


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def _allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB]
    return set(np.flatnonzero(bits).tolist())


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_compiles_are_cached_and_errors_name_the_field(compiler: GrammarCompiler) -> None:
    so = StructuredOutputsParams(regex="[0-9]{3}")
    first = compiler.compile(so)
    assert compiler.compile(StructuredOutputsParams(regex="[0-9]{3}")) is first
    assert first.result().compile_seconds > 0
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(StructuredOutputsParams(regex="([0-9]")).result()
    assert err.value.field == "sampling_params.structured_outputs.regex"


def test_stop_tokens_are_allowed_exactly_where_the_grammar_accepts(
        compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(StructuredOutputsParams(choice=("ab", "abab"))).result()
    batch = GrammarBatch(VOCAB)
    batch.add("r", grammar, (STOP, EOS), [])
    masks = batch.masks(["r", "free"], np.array([True, True]), 4)
    assert masks.shape == (4, (VOCAB + 31) // 32)
    assert STOP not in _allowed(masks[0]) and EOS not in _allowed(masks[0])
    assert _allowed(masks[1]) == set(range(VOCAB))  # an unconstrained row allows all
    batch.advance("r", 0, _ids(tokenizer, "ab"))
    batch.advance("r", 0, _ids(tokenizer, "ab"))  # seen again (an early read): no effect
    after = _allowed(batch.masks(["r"], np.array([True]), 1)[0])
    assert {STOP, EOS} <= after  # "ab" is complete: the request may end
    assert _ids(tokenizer, "ab")[0] in after or _ids(tokenizer, "a")[0] in after


def test_draft_masks_follow_the_drafts_and_drafts_are_cut(
        compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(StructuredOutputsParams(regex="[0-9]{4}")).result()
    batch = GrammarBatch(VOCAB)
    batch.add("r", grammar, (EOS,), [])
    digits = _ids(tokenizer, "1") + _ids(tokenizer, "2")
    letter = _ids(tokenizer, "x")
    drafts = np.array([digits + letter], np.int32)  # [1, k=3]
    masks = batch.draft_masks(["r"], np.array([True]), drafts, np.array([3], np.int32))
    rows = [_allowed(m) for m in masks]
    assert digits[0] in rows[0] and letter[0] not in rows[0]
    assert digits[1] in rows[1] and EOS not in rows[2]
    assert rows[3] == set(range(VOCAB))  # past the refused draft: never read
    assert batch.valid_drafts("r", [*digits, *letter]) == digits
    # The walk along the drafts left the matcher where it was.
    assert _allowed(batch.masks(["r"], np.array([True]), 1)[0]) == rows[0]
    four = _ids(tokenizer, "1234")
    assert batch.valid_drafts("r", [*four, EOS, *digits]) == [*four, EOS]


def test_threaded_and_serial_fills_give_the_same_masks(
        compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    grammars = [compiler.compile(StructuredOutputsParams(regex=r"[0-9]{2,6}")).result(),
                compiler.compile(StructuredOutputsParams(choice=("alpha", "beta"))).result()]
    rows = [f"r{i}" for i in range(8)]
    masks = []
    for threaded in (True, False):
        batch = GrammarBatch(VOCAB, threaded=threaded)
        for i, rid in enumerate(rows):
            batch.add(rid, grammars[i % 2], (EOS,), _ids(tokenizer, "12") if i % 2 == 0 else [])
        masks.append(batch.masks(rows, np.ones(len(rows), bool), 8))
    assert np.array_equal(masks[0], masks[1])
    assert EOS in _allowed(masks[1][0]) and EOS not in _allowed(masks[1][1])
