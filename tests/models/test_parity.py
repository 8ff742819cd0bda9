"""Our paged forward gives transformers' logits for every family and every row kind.

Each family's tiny checkpoint has a sliding window (where the family has one)
shorter than the sequences, so windowed layers really mask. Page ids come
from a shuffled pool, so no request's pages are contiguous.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.models.conftest import FAMILIES, Pair
from tests.models.paged import PagedSession, Row, hf_logits

ATOL = 1e-4


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_prompt_prefill(make_pair: Callable[..., Pair], family: str) -> None:
    pair = make_pair(family)
    ids = tokens(1, 22)
    (got,) = PagedSession(pair.loaded).step([Row("a", ids, 0, num_logits=len(ids))])
    want = hf_logits(pair.hf, ids)
    assert np.ptp(want) > 1.0  # the logits are far from flat, so 1e-4 is a real bound
    assert_close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill(make_pair: Callable[..., Pair], family: str) -> None:
    pair = make_pair(family)
    ids = tokens(2, 22)
    session = PagedSession(pair.loaded, seed=1)
    got, start = [], 0
    for size in (5, 7, 10):
        (chunk,) = session.step([Row("a", ids[start:start + size], start, num_logits=size)])
        got.append(chunk)
        start += size
    assert_close(np.concatenate(got), hf_logits(pair.hf, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_step_by_step_decode(make_pair: Callable[..., Pair], family: str) -> None:
    pair = make_pair(family)
    ids = tokens(3, 22)
    session = PagedSession(pair.loaded, seed=2)
    (prefill,) = session.step([Row("a", ids[:6], 0, num_logits=1)])
    got = [prefill]
    for pos in range(6, len(ids)):
        (one,) = session.step([Row("a", [ids[pos]], pos)])
        got.append(one)
    assert_close(np.concatenate(got), hf_logits(pair.hf, ids)[5:])


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_rows_in_one_step(make_pair: Callable[..., Pair], family: str) -> None:
    """One call holds a prefill chunk, a single-token decode and a 4-draft verification."""
    pair = make_pair(family)
    a, b, c = tokens(4, 20), tokens(5, 20), tokens(6, 20)
    session = PagedSession(pair.loaded, seed=3)
    session.step([Row("a", a[:8], 0, 0), Row("b", b[:12], 0, 0), Row("c", c[:4], 0, 0)])
    session.step([Row("c", c[4:14], 4, 0)])
    got_a, got_b, got_c = session.step([
        Row("a", a[8:19], 8, num_logits=11),  # the prompt's next chunk, all positions
        Row("b", [b[12]], 12, num_logits=1),  # decode
        Row("c", c[14:19], 14, num_logits=5),  # last token + 4 drafts to verify
    ])
    assert_close(got_a, hf_logits(pair.hf, a)[8:19])
    assert_close(got_b, hf_logits(pair.hf, b)[12:13])
    assert_close(got_c, hf_logits(pair.hf, c)[14:19])
