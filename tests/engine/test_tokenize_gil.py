"""Tokenizing a long text leaves the GIL to other threads (esurge.engine.tokenize).

`Tokenizer.encode` / `decode` hold the GIL throughout, so a request's
tokenizing on a worker thread still stopped the server's event loop: a 1 MB
Tokenize call held every other RPC for 0.8-1.0 s. The check: a thread that
only counts gets, while the tokenizer runs, a good share of the counts it
gets alone (with encode it got about 1%).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from esurge.engine.tokenize import decode_ids, encode_ids

TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "tiny-stdlib" / "tokenizer.json"


def _counts_while(work: Callable[[], object]) -> tuple[int, float]:
    """(counts a spinning thread made while `work` ran, work's seconds)."""
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.02)
    before, began = count[0], time.perf_counter()
    work()
    elapsed, during = time.perf_counter() - began, count[0] - before
    stop.set()
    thread.join()
    return during, elapsed


@pytest.mark.parametrize("kind", ["encode", "decode"])
def test_tokenizing_leaves_the_gil_to_other_threads(kind: str) -> None:
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    text = "def main(self):\n    return x + 1\n" * 12_000
    ids = encode_ids(tokenizer, text)
    assert ids == tokenizer.encode(text).ids
    assert decode_ids(tokenizer, ids) == tokenizer.decode(ids)
    work = ((lambda: encode_ids(tokenizer, text)) if kind == "encode"
            else (lambda: decode_ids(tokenizer, ids * 4)))
    alone, alone_s = _counts_while(lambda: time.sleep(0.1))
    during, during_s = _counts_while(work)
    share = (during / during_s) / (alone / alone_s)
    assert share > 0.25, f"the other thread ran at {share:.1%} of its speed"
