"""Tokenizers for the structured-output backend bench: the default model's,
and a 262k-token vocabulary built from it (nothing is downloaded).

The big one is SmolLM2's tokenizer.json with its vocabulary and merges
extended programmatically and reproducibly (whitespace runs, characters of
several scripts from their UTF-8 bytes, CJK bigrams, English compounds). Its
merges rank below all the original ones, so ASCII text tokenizes exactly as
with SmolLM2: the bench then measures vocabulary size, not tokenization.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["BIG_VOCAB", "GGUF", "extended_tokenizer", "smollm2_tokenizer"]

GGUF = Path("~/.cache/esurge/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
BIG_VOCAB = 262144



def smollm2_tokenizer() -> Any:
    """The default model's transformers tokenizer, read from its cached GGUF."""
    from esurge.models.checkpoint import open_checkpoint

    path = GGUF.expanduser()
    if not path.is_file():
        raise SystemExit(f"{path} is missing (the default model's GGUF is fetched on first serve)")
    source = open_checkpoint(path)
    try:
        tokenizer = source.tokenizer()
    finally:
        source.close()
    if tokenizer is None:
        raise SystemExit(f"{path} has no tokenizer")
    return tokenizer


def byte_level_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the character ByteLevel BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class VocabExtender:
    """Grows a BPE vocabulary by merges of two tokens it already has, up to `size`."""

    def __init__(self, vocab: dict[str, int], merges: list[list[str]], size: int) -> None:
        if sorted(vocab.values()) != list(range(len(vocab))):
            raise ValueError("the base vocabulary's ids are not 0..n-1")
        self.vocab, self.merges, self.size = vocab, merges, size

    @property
    def full(self) -> bool:
        return len(self.vocab) >= self.size

    def merge(self, left: str, right: str) -> str | None:
        """left+right as a token (added if new); None if a part is missing or the vocab is full."""
        token = left + right
        if token in self.vocab:
            return token
        if self.full or left not in self.vocab or right not in self.vocab:
            return None
        self.vocab[token] = len(self.vocab)
        self.merges.append([left, right])
        return token

    def chain(self, pieces: Sequence[str]) -> str | None:
        """The concatenation of pieces, merged left to right."""
        token: str | None = pieces[0]
        for piece in pieces[1:]:
            if token is None:
                return None
            token = self.merge(token, piece)
        return token


SCRIPTS = [(0x00C0, 0x017F), (0x0391, 0x03C9), (0x0400, 0x04FF), (0x0621, 0x064A),
           (0x0900, 0x097F), (0x3041, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3)]


def extend_vocab(vocab: dict[str, int], merges: list[list[str]], size: int) -> None:
    """Extend vocab and merges in place to `size` tokens (seeded: the same every run)."""
    chars = byte_level_chars()
    grow = VocabExtender(vocab, merges, size)
    for n in range(2, 33):
        grow.chain(["Ġ"] * n)
        grow.chain(["Ċ"] + ["Ġ"] * (n - 1))
    cjk: list[str] = []
    for lo, hi in SCRIPTS:
        for code in range(lo, hi + 1):
            token = grow.chain([chars[b] for b in chr(code).encode()])
            if token is not None and code >= 0x4E00:
                cjk.append(token)
    heads = [t for t in vocab if t.startswith("Ġ") and t[1:].isascii() and t[1:].isalpha()]
    tails = [t for t in vocab if len(t) >= 2 and t.isascii() and t.isalpha()]
    rng = random.Random(0)
    while not grow.full:
        if rng.random() < 0.5:
            grow.merge(rng.choice(heads), rng.choice(tails))
        else:
            grow.merge(rng.choice(cjk), rng.choice(cjk))


def extended_tokenizer(base: Any, size: int = BIG_VOCAB) -> Any:
    """`base` (a byte-level BPE) with its vocabulary extended to `size` tokens, as a
    transformers PreTrainedTokenizerFast with the same special tokens."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(base.backend_tokenizer.to_str())
    model = spec["model"]
    if model["type"] != "BPE" or spec["pre_tokenizer"]["type"] != "ByteLevel":
        raise ValueError("the base tokenizer is not a byte-level BPE")
    extend_vocab(model["vocab"], model["merges"], size)
    backend = Tokenizer.from_str(json.dumps(spec))
    specials = {k: getattr(base, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if getattr(base, k, None) is not None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    if len(tokenizer) != size:
        raise ValueError(f"the extended tokenizer has {len(tokenizer)} tokens, not {size}")
    return tokenizer
