"""An Eagle head's training data computed once per token: the target's features and labels.

Running the target for every training batch costs as much as the head's own
step on a CPU (SmolLM2 on 2 AVX2 cores: 11 s per 2,048 tokens), for features
that never change. So a set of sequences (each a chat: prompt and the
target's answer) is run through the target once, from its start, exactly as
inference sees it, and its features (bfloat16) and sparse next-token labels
are kept; training then draws batches of whole sequences from them, for as
many epochs as it likes. `--data-cache` keeps them on disk between runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tools.eagle_training import LABEL_TOP, Labels, sparse_labels

__all__ = ["FeatureSet", "pad_sequences"]

# windows [B, L] int32 -> (features [B, L, F], final hidden [B, L, H], logits [B, L, V])
TargetFn = Callable[[np.ndarray], tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]]


def pad_sequences(sequences: list[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """([S, length] int32 tokens padded with 0, [S] lengths); longer sequences are cut."""
    tokens = np.zeros((len(sequences), length), np.int32)
    lengths = np.zeros(len(sequences), np.int32)
    for i, seq in enumerate(sequences):
        n = min(len(seq), length)
        tokens[i, :n], lengths[i] = seq[:n], n
    return tokens, lengths


@dataclass(frozen=True, slots=True)
class FeatureSet:
    """Sequences with the target's features and labels at every position."""

    tokens: np.ndarray  # [S, L] int32, 0 past each length
    lengths: np.ndarray  # [S] int32
    features: np.ndarray  # [S, L, F] bfloat16
    label_ids: np.ndarray  # [S, L, LABEL_TOP] int32 (draft vocabulary)
    label_probs: np.ndarray  # [S, L, LABEL_TOP] float32
    d2t: np.ndarray  # [draft_vocab] int64: the draft vocabulary the labels index

    @classmethod
    def compute(cls, target: TargetFn, sequences: list[np.ndarray], length: int,
                d2t: np.ndarray, batch: int,
                progress: Callable[[int, int], None] | None = None) -> FeatureSet:
        """Run the target over the sequences, `batch` at a time (the last batch padded)."""
        tokens, lengths = pad_sequences(sequences, length)
        feats, ids, probs = [], [], []
        d2t_dev = jnp.asarray(d2t, jnp.int32)
        for start in range(0, len(tokens), batch):
            rows = tokens[start:start + batch]
            real = len(rows)
            if real < batch:
                rows = np.concatenate([rows, np.zeros((batch - real, length), np.int32)])
            features, _, logits = target(rows)
            valid = jnp.asarray(np.arange(length)[None, :] < lengths[start:start + batch, None])
            labels = sparse_labels(logits[:real], d2t_dev, valid)
            feats.append(np.asarray(features[:real].astype(jnp.bfloat16)))
            ids.append(np.asarray(labels.ids))
            probs.append(np.asarray(labels.probs))
            if progress is not None:
                progress(start + real, len(tokens))
        return cls(tokens, lengths, np.concatenate(feats), np.concatenate(ids),
                   np.concatenate(probs), np.asarray(d2t, np.int64))

    def extended(self, more: FeatureSet) -> FeatureSet:
        """This set followed by `more` (same length and draft vocabulary)."""
        if more.tokens.shape[1] != self.tokens.shape[1] or not np.array_equal(more.d2t,
                                                                              self.d2t):
            raise ValueError("only a set of the same length and draft vocabulary extends "
                             "another")
        return FeatureSet(*(np.concatenate([getattr(self, name), getattr(more, name)])
                            for name in ("tokens", "lengths", "features", "label_ids",
                                         "label_probs")), self.d2t)

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) positions."""
        return int(self.lengths.sum())

    def batches(self, batch: int, rng: np.random.Generator
                ) -> Iterator[tuple[np.ndarray, np.ndarray, Labels]]:
        """Endless (features [B, L, F], tokens [B, L], labels) batches: every sequence
        once per epoch, in a fresh order each epoch."""
        if batch > len(self.tokens):
            raise ValueError(f"batch {batch} exceeds the {len(self.tokens)} sequences")
        positions = np.arange(self.tokens.shape[1])
        while True:
            order = rng.permutation(len(self.tokens))
            for start in range(0, len(order) - batch + 1, batch):
                pick = order[start:start + batch]
                valid = positions[None, :] < self.lengths[pick, None]
                yield (self.features[pick], self.tokens[pick],
                       Labels(jnp.asarray(self.label_ids[pick]),
                              jnp.asarray(self.label_probs[pick]), jnp.asarray(valid)))

    def save(self, path: Path) -> None:
        """Write the set to one .npz file (features stored as their bfloat16 bits)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=self.tokens, lengths=self.lengths,
                 features=self.features.view(np.uint16), label_ids=self.label_ids,
                 label_probs=self.label_probs, d2t=self.d2t)

    @classmethod
    def load(cls, path: Path) -> FeatureSet:
        """Read a set written by `save`."""
        with np.load(path) as data:
            features = data["features"].view(ml_dtypes.bfloat16)
            label_ids = data["label_ids"]
            if label_ids.shape[-1] != LABEL_TOP:
                raise ValueError(f"{path} keeps {label_ids.shape[-1]} labels per position, "
                                 f"this trainer {LABEL_TOP}")
            return cls(data["tokens"], data["lengths"], features, label_ids,
                       data["label_probs"], data["d2t"])
