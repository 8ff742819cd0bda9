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

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from esurge.models import RequestChunk, build_forward_batch, init_kv_cache
from esurge.models.loader import LoadedModel
from esurge.runner.device_step import model_step_features
from esurge.spec_decode.config import EagleConfig
from tools.eagle_training import LABEL_TOP, Labels, sparse_labels

__all__ = ["PAGE_SIZE", "FeatureSet", "TargetFeatures", "draft_vocabulary", "pad_sequences"]

PAGE_SIZE = 16

# windows [B, L] int32 -> (features [B, L, F], final hidden [B, L, H], logits [B, L, V])
TargetFn = Callable[[np.ndarray], tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]]


def draft_vocabulary(stream: np.ndarray, config: EagleConfig) -> np.ndarray:
    """The draft vocabulary: the most frequent tokens, as offsets d2t[d] = id - d."""
    counts = np.bincount(stream, minlength=config.vocab_size)
    keep = np.sort(np.argsort(-counts, kind="stable")[:config.draft_vocab_size])
    return (keep - np.arange(config.draft_vocab_size)).astype(np.int64)


class TargetFeatures:
    """The target's features, final hidden states and logits for batches of windows."""

    def __init__(self, target: LoadedModel, feature_layers: tuple[int, ...], batch: int,
                 context: int) -> None:
        self.target, self.feature_layers = target, feature_layers
        self.batch, self.context = batch, context
        pages_per = -(-context // PAGE_SIZE)
        self.num_pages = batch * pages_per + 1
        self.cache = init_kv_cache(target.cache_groups(self.num_pages, PAGE_SIZE))
        self.tables = [list(range(1 + i * pages_per, 1 + (i + 1) * pages_per))
                       for i in range(batch)]

    def __call__(self, windows: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
        """windows [B, L] -> features [B, L, F], hidden [B, L, H], logits [B, L, V]."""
        b, n = windows.shape
        groups = self.cache.num_groups
        chunks = [RequestChunk(w.tolist(), 0, [t] * groups, num_logits=n)
                  for w, t in zip(windows, self.tables, strict=True)]
        fb = build_forward_batch(chunks, page_size=PAGE_SIZE, num_groups=groups,
                                 num_tokens_bucket=b * n, num_reqs_bucket=b,
                                 max_pages_per_req=len(self.tables[0]),
                                 num_logits_bucket=b * n, num_pages=self.num_pages)
        logits, hidden, features, self.cache, _ = model_step_features(
            self.target.model_state, self.cache, fb, self.feature_layers)
        return (features.reshape(b, n, -1), hidden.reshape(b, n, -1),
                logits.reshape(b, n, -1))


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
        def both(name: str) -> np.ndarray:
            return np.concatenate([getattr(self, name), getattr(more, name)])

        return FeatureSet(both("tokens"), both("lengths"), both("features"), both("label_ids"),
                          both("label_probs"), self.d2t)

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
