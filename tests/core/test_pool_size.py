"""A pool sized from free memory keeps its size while free memory wobbles."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from esurge.core.page_budget import stable_page_count


@given(st.integers(min_value=1, max_value=10**9))
def test_rounding_keeps_five_significant_bits_and_loses_under_a_sixteenth(pages: int) -> None:
    kept = stable_page_count(pages)
    assert kept <= pages and pages - kept < max(pages / 16, 1)
    assert stable_page_count(kept) == kept
    assert kept >> max(kept.bit_length() - 5, 0) << max(kept.bit_length() - 5, 0) == kept


def test_free_memory_wobble_gives_the_same_pool() -> None:
    # 7262 pages was one start of the default model; a few % either way is the
    # next start's free memory.
    assert {stable_page_count(p) for p in range(7170, 7420)} == {7168}
    assert stable_page_count(15) == 15 and stable_page_count(17) == 17
    with pytest.raises(ValueError, match="pages must be >= 1"):
        stable_page_count(0)
