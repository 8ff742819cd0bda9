"""Training data for the default model: a fixed file split, token streams, windows.

The corpus is the Python standard library's top-level source files, which
every machine with Python has. Whole files are held out for evaluation: the
file at sorted index i is held out when i % HELDOUT_EVERY == HELDOUT_OFFSET.
Each file's tokens are followed by EOS and the files are concatenated into
one stream per split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tools.lm_training import EOS_ID

__all__ = [
    "HELDOUT_EVERY", "HELDOUT_OFFSET", "FileSplit", "WindowSampler", "eval_windows", "read_texts",
    "split_files", "token_stream", "unigram_nll",
]

HELDOUT_EVERY = 10
HELDOUT_OFFSET = 5


@dataclass(frozen=True, slots=True)
class FileSplit:
    """Training and held-out files."""

    train: tuple[Path, ...]
    heldout: tuple[Path, ...]


def split_files(files: list[Path]) -> FileSplit:
    """Hold out every HELDOUT_EVERY-th file of the sorted list (starting at HELDOUT_OFFSET)."""
    ordered = sorted(files)
    held = tuple(p for i, p in enumerate(ordered) if i % HELDOUT_EVERY == HELDOUT_OFFSET)
    train = tuple(p for i, p in enumerate(ordered) if i % HELDOUT_EVERY != HELDOUT_OFFSET)
    if not train or not held:
        raise ValueError(f"need at least {HELDOUT_OFFSET + 2} files for a train/held-out "
                         f"split, got {len(ordered)}")
    return FileSplit(train=train, heldout=held)


def read_texts(files: tuple[Path, ...]) -> list[str]:
    """File contents; undecodable bytes become U+FFFD rather than failing."""
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:  # [N] int32
    """All texts tokenized, each followed by EOS, concatenated."""
    parts = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([EOS_ID], np.int32))
    return np.concatenate(parts)


class WindowSampler:
    """Shuffled windows of context + 1 tokens, one epoch after another.

    An epoch cuts the stream into non-overlapping windows from an offset and
    visits them in a permutation; both come from (seed, epoch), so a batch
    is a pure function of the cursor (windows consumed so far) and training
    resumes exactly from a saved cursor.
    """

    def __init__(self, stream: np.ndarray, context: int, seed: int) -> None:  # stream: [N]
        if len(stream) < 2 * (context + 1):
            raise ValueError(f"token stream of {len(stream)} tokens is too short for "
                             f"windows of context {context}")
        self.stream, self.context, self.seed = stream, context, seed
        self.windows_per_epoch = (len(stream) - context - 1) // context
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            offset = int(rng.integers(0, self.context))
            self._epochs = {epoch: (offset, rng.permutation(self.windows_per_epoch))}
        return self._epochs[epoch]

    def batch(self, cursor: int, size: int) -> np.ndarray:  # [size, context + 1] int32
        """The `size` windows starting at window number `cursor`."""
        rows = []
        for g in range(cursor, cursor + size):
            offset, order = self._epoch(g // self.windows_per_epoch)
            start = offset + int(order[g % self.windows_per_epoch]) * self.context
            rows.append(self.stream[start:start + self.context + 1])
        return np.stack(rows)


def eval_windows(stream: np.ndarray, context: int) -> np.ndarray:  # [W, context + 1]
    """Non-overlapping windows from the start (consecutive windows share one boundary
    token, so every token after the first is predicted once); the ragged tail is dropped."""
    count = (len(stream) - 1) // context
    if count < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than "
                         f"one window of context {context}")
    return np.stack([stream[i * context:i * context + context + 1] for i in range(count)])


def unigram_nll(train: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Mean negative log-likelihood (nats) of targets under add-one-smoothed train counts."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts) - math.log(float(counts.sum()))
    return float(-log_probs[targets.reshape(-1)].mean())
