"""The BPE tokenizer trainer's newline option."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.tokenizer_training import stdlib_texts, train_bpe_tokenizer

CODE = "def f():\n    return 1\n\n\nx = f()\n"


@pytest.mark.parametrize("isolate", [False, True])
def test_newline_tokens(tmp_path: Path, isolate: bool) -> None:
    tok = train_bpe_tokenizer(stdlib_texts(max_files=8), 400, tmp_path,
                              isolate_newlines=isolate)
    pieces = [tok.decode([i]) for i in tok.encode(CODE).ids]
    assert "".join(pieces) == CODE
    newline_pieces = [p for p in pieces if "\n" in p]
    if isolate:
        assert newline_pieces == ["\n"] * 5
    else:  # the default merges a newline with the indentation after it
        assert any(p != "\n" and p.startswith("\n") for p in newline_pieces)
