"""A minimal paged driver for tests: page allocation, batching, greedy generation.

It stands in for the runner: pages come from a shuffled free list (so page ids
are never contiguous), every step is padded to one fixed bucket, and the
model runs through `jit_forward` with the cache donated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from esurge.models import (
    LoadedModel,
    RequestChunk,
    build_forward_batch,
    init_kv_cache,
    jit_forward,
)

TOKENS, REQS, LOGITS, MAX_PAGES, PAGE_SIZE = 24, 4, 24, 16, 4


@dataclass
class Row:
    """One request's share of a step: which request, its tokens, where they start."""

    key: str
    token_ids: list[int]
    start: int
    num_logits: int = 1


@dataclass
class PagedSession:
    """A KV cache plus per-request page tables over a shuffled pool."""

    loaded: LoadedModel
    num_pages: int = 160
    seed: int = 0
    tables: dict[str, list[list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.groups = self.loaded.cache_groups(self.num_pages, PAGE_SIZE)
        self.kv = init_kv_cache(self.groups)
        rng = np.random.default_rng(self.seed)
        self.free = [int(p) for p in rng.permutation(np.arange(1, self.num_pages))]

    @property
    def num_groups(self) -> int:
        return len(self.groups.groups)

    def _ensure(self, key: str, num_tokens: int) -> list[list[int]]:
        tables = self.tables.setdefault(key, [[] for _ in range(self.num_groups)])
        for table in tables:
            while len(table) * PAGE_SIZE < num_tokens:
                table.append(self.free.pop())
        return tables

    def step(self, rows: Sequence[Row]) -> list[np.ndarray]:
        """Run one padded step; each row's logits [num_logits, vocab]."""
        chunks = [
            RequestChunk(r.token_ids, r.start, self._ensure(r.key, r.start + len(r.token_ids)),
                         r.num_logits)
            for r in rows
        ]
        batch = build_forward_batch(
            chunks, page_size=PAGE_SIZE, num_groups=self.num_groups, num_tokens_bucket=TOKENS,
            num_reqs_bucket=REQS, max_pages_per_req=MAX_PAGES, num_logits_bucket=LOGITS,
            num_pages=self.num_pages,
        )
        logits, _, self.kv = jit_forward(self.loaded.model_state, self.kv, batch)
        flat = np.asarray(logits)
        out, at = [], 0
        for r in rows:
            out.append(flat[at:at + r.num_logits])
            at += r.num_logits
        return out


def hf_logits(model: Any, ids: Sequence[int]) -> np.ndarray:  # [len(ids), vocab]
    """transformers' logits for every position of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def hf_generate(model: Any, prompt: Sequence[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of one prompt."""
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new,
                             do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def greedy_generate(session: PagedSession, prompts: Sequence[Sequence[int]],
                    max_new: int) -> list[list[int]]:
    """Greedy continuation of all prompts together, TOKENS tokens per step.

    Decode rows take one token each; prompts fill the rest of the budget in
    chunks, so steps mix decodes with (chunked) prefills.
    """
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new for o in outputs):
        rows, budget = [], TOKENS
        for i, seq in enumerate(seqs):
            n = min(len(seq) - computed[i], budget)
            if len(outputs[i]) >= max_new or n == 0:
                continue
            done = computed[i] + n == len(seq)
            rows.append((i, Row(f"r{i}", seq[computed[i]:computed[i] + n], computed[i],
                                1 if done else 0)))
            budget -= n
        logits = session.step([row for _, row in rows])
        for (i, row), row_logits in zip(rows, logits, strict=True):
            computed[i] += len(row.token_ids)
            if row.num_logits:
                token = int(np.argmax(row_logits[-1]))
                seqs[i].append(token)
                outputs[i].append(token)
    return outputs
