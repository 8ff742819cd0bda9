"""The boundary type between the KV cache manager and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVCachePages"]


@dataclass(frozen=True, slots=True)
class KVCachePages:
    """Page ids per cache group (one tuple per group, in group order)."""

    page_ids: tuple[tuple[int, ...], ...]

    @classmethod
    def empty(cls, num_groups: int) -> KVCachePages:
        """No pages in any of num_groups groups."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups!r}")
        return cls(((),) * num_groups)

    def is_empty(self) -> bool:
        """True when no group holds a page entry."""
        return not any(self.page_ids)

    def __add__(self, other: KVCachePages) -> KVCachePages:
        """Group-wise concatenation (e.g. prefix hits + newly allocated pages)."""
        if len(self.page_ids) != len(other.page_ids):
            raise ValueError(
                f"cannot join pages of {len(self.page_ids)} and {len(other.page_ids)} groups"
            )
        return KVCachePages(tuple(a + b for a, b in zip(self.page_ids, other.page_ids,
                                                          strict=True)))
