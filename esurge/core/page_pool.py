"""The pool of KV pages: reference counts, the LRU free queue and the hash index.

Page 0 is the null page: it is never handed out, never freed and stands for
"no page" in positional page lists (a sliding-window group's pages that fell
out of its window). A page with reference count 0 sits in the free queue; if
it still carries a content hash it stays findable through the index of the
cache group it last served, until `take` evicts it for reuse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from esurge.core.kv_events import KVEventLog
from esurge.core.page_hash import PageHash

__all__ = ["NULL_PAGE", "PagePool"]

NULL_PAGE = 0


class PagePool:
    """num_pages pages shared by num_groups cache groups; page 0 is reserved."""

    __slots__ = ("_free", "_group", "_hash", "_index", "_num_pages", "_ref", "events")

    def __init__(self, num_pages: int, num_groups: int = 1) -> None:
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 2:
            raise ValueError(
                f"num_pages must be an int >= 2 (page 0 is the reserved null page), "
                f"got {num_pages!r}"
            )
        if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
            raise ValueError(f"num_groups must be an int >= 1, got {num_groups!r}")
        self._num_pages = num_pages
        self._ref = [0] * num_pages
        self._hash: list[PageHash | None] = [None] * num_pages
        # Stores, evictions and clears, for consumers outside the engine.
        self.events = KVEventLog()
        self._group = [0] * num_pages
        # Insertion order is eviction order: the front is the least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._index: list[dict[PageHash, int]] = [{} for _ in range(num_groups)]

    @property
    def num_pages(self) -> int:
        """All pages, the null page included."""
        return self._num_pages

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self._num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free ones and evictable cached ones."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by someone (reference count > 0)."""
        return 1.0 - len(self._free) / (self._num_pages - 1)

    @property
    def num_groups(self) -> int:
        """Cache groups the hash index is split into."""
        return len(self._index)

    def ref_count(self, page_id: int) -> int:
        """How many holders page_id has (0 for a free page)."""
        self._check_page(page_id)
        return self._ref[page_id]

    def page_hash(self, page_id: int) -> PageHash | None:
        """The content hash page_id is registered under, or None."""
        self._check_page(page_id)
        return self._hash[page_id]

    def is_free(self, page_id: int) -> bool:
        """True while page_id waits in the free queue."""
        self._check_page(page_id)
        return page_id in self._free

    def free_page_ids(self) -> list[int]:
        """The free queue, front (next to be handed out) first."""
        return list(self._free)

    def cached_pages(self, group: int) -> Mapping[PageHash, int]:
        """Read-only view of a group's index: content hash -> page id."""
        return self._index[group]

    def num_cached_pages(self) -> int:
        """Pages currently registered under a content hash (held or free)."""
        return sum(len(index) for index in self._index)

    def take(self, count: int, group: int) -> list[int]:
        """Hand out count pages from the front of the free queue to a group.

        Cached pages among them are evicted: their hash leaves the index.
        """
        if count > len(self._free):
            raise ValueError(f"cannot take {count} pages: only {len(self._free)} are free")
        free, ref, hashes = self._free, self._ref, self._hash
        taken: list[int] = []
        for _ in range(count):
            page_id, _ = free.popitem(last=False)
            page_hash = hashes[page_id]
            if page_hash is not None:
                del self._index[self._group[page_id]][page_hash]
                hashes[page_id] = None
                self.events.removed(self._group[page_id], page_hash)
            ref[page_id] = 1
            self._group[page_id] = group
            taken.append(page_id)
        return taken

    def touch(self, page_ids: Iterable[int]) -> None:
        """Add a holder to each page (a prefix hit), pulling free ones off the queue."""
        ref, free = self._ref, self._free
        for page_id in page_ids:
            if page_id == NULL_PAGE:
                raise ValueError("the null page 0 cannot be held")
            if ref[page_id] == 0:
                if self._hash[page_id] is None:
                    raise ValueError(f"page {page_id} is free and not cached: nothing to share")
                del free[page_id]
            ref[page_id] += 1

    def release(self, page_ids: Iterable[int]) -> None:
        """Drop a holder from each page, in order; pages left unheld join the queue's back."""
        ref, free = self._ref, self._free
        for page_id in page_ids:
            count = ref[page_id]
            if count <= 0 or page_id == NULL_PAGE:
                raise ValueError(f"page {page_id} is not held: it cannot be released")
            ref[page_id] = count - 1
            if count == 1:
                free[page_id] = None

    def cache_page(self, group: int, page_hash: PageHash, page_id: int) -> bool:
        """Register a held, full page under its content hash.

        False (and nothing changes) when the page is already registered or
        another page of the group already holds that content.
        """
        if self._ref[page_id] <= 0 or page_id == NULL_PAGE:
            raise ValueError(f"page {page_id} is not held: only held pages can be cached")
        index = self._index[group]
        if self._hash[page_id] is not None or page_hash in index:
            return False
        index[page_hash] = page_id
        self._hash[page_id] = page_hash
        self._group[page_id] = group
        return True

    def reset_cache(self) -> bool:
        """Forget every content hash; refused (False) while any page is held."""
        if len(self._free) != self._num_pages - 1:
            return False
        for index in self._index:
            for page_id in index.values():
                self._hash[page_id] = None
            index.clear()
        self.events.cleared()
        return True

    def _check_page(self, page_id: int) -> None:
        if not 0 <= page_id < self._num_pages:
            raise ValueError(f"page_id must be in [0, {self._num_pages}), got {page_id!r}")
