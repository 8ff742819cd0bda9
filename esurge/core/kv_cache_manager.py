"""The KV cache manager: which pages each request holds, per cache group.

The scheduler talks to it through `KVCachePages` (page ids per group) and
request objects; the pool's internals stay here. A request's page list per
group is positional: entry j covers tokens [j * page_size, (j + 1) *
page_size). Sliding-window and chunked-local groups replace the entries that
fell out of reach with the null page 0 and give the pages back, so their
memory is bounded by the window, not the sequence. Prefix caching shares full
pages by chained content hash; the hashes of a request are kept here, keyed by
its id, and extended only when new pages fill up.
"""

from __future__ import annotations

from esurge.core.kv_cache_pages import KVCachePages
from esurge.core.kv_cache_spec import (
    AttentionSpec,
    CacheGroupsConfig,
    ChunkedLocalAttentionSpec,
    SlidingWindowSpec,
)
from esurge.core.page_budget import computed_reaching, peak_pages
from esurge.core.page_hash import ExtraKey, PageHash, hash_pages
from esurge.core.page_pool import NULL_PAGE, PagePool
from esurge.core.prefix_lookup import hit_pages, longest_hit
from esurge.request import EngineRequest

__all__ = ["KVCacheManager", "KVCachePages"]


class _RequestState:
    """What the manager tracks for one request."""

    __slots__ = ("extra_keys", "hashes", "length", "nulled", "num_cached", "pages",
                 "release_at")

    def __init__(self, num_groups: int, cache_salt: str | None) -> None:
        self.pages: list[list[int]] = [[] for _ in range(num_groups)]
        self.length = 0  # entries in every group's page list
        self.nulled = [0] * num_groups  # leading entries already given back (windowed groups)
        # The computed-token count at which a windowed group can give back its next page.
        self.release_at = 0
        self.hashes: list[PageHash] = []  # of full pages of known tokens, in order
        self.num_cached = 0  # leading pages already offered to the prefix cache
        self.extra_keys: tuple[ExtraKey, ...] = () if cache_salt is None else (cache_salt,)


def _is_windowed(spec: AttentionSpec) -> bool:
    return isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec)


class KVCacheManager:
    """Allocates, shares and frees KV pages for requests across cache groups."""

    def __init__(self, kv_cache_config: CacheGroupsConfig, max_model_len: int,
                 enable_caching: bool = True) -> None:
        if not isinstance(kv_cache_config, CacheGroupsConfig):
            raise ValueError(f"kv_cache_config must be a CacheGroupsConfig, got "
                             f"{type(kv_cache_config).__name__}")
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool) or (
            max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
        if not isinstance(enable_caching, bool):
            raise ValueError(f"enable_caching must be a bool, got {enable_caching!r}")
        self._config = kv_cache_config
        self._max_model_len = max_model_len
        self._enable_caching = enable_caching
        self._ps = kv_cache_config.page_size
        self._specs = tuple(g.spec for g in kv_cache_config.groups)
        self._num_groups = len(self._specs)
        self._windowed = tuple(i for i, s in enumerate(self._specs) if _is_windowed(s))
        self._pool = PagePool(kv_cache_config.num_pages, self._num_groups)
        self._states: dict[str, _RequestState] = {}
        self._empty = KVCachePages.empty(self._num_groups)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- sizes -------------------------------------------------------------

    @property
    def kv_cache_config(self) -> CacheGroupsConfig:
        """The pool size and cache groups this manager serves."""
        return self._config

    @property
    def num_groups(self) -> int:
        """Cache groups (page lists per request)."""
        return self._num_groups

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._ps

    @property
    def enable_caching(self) -> bool:
        """Whether full pages are shared by content hash."""
        return self._enable_caching

    @property
    def num_usable_pages(self) -> int:
        """num_pages - 1: the null page is never handed out."""
        return self._pool.num_usable_pages

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now (free + evictable cached)."""
        return self._pool.num_free_pages

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use (reference count > 0)."""
        return self._pool.usage

    @property
    def pool(self) -> PagePool:
        """The page pool, for inspection (tests, metrics); the scheduler needs none of it."""
        return self._pool

    def max_pages_per_request(self) -> int:
        """Page-list length of a max_model_len request (the same in every group)."""
        return -(-self._max_model_len // self._ps)

    def peak_pages(self, num_tokens: int, max_tokens_per_step: int | None = None) -> int:
        """Most pages (all groups) a request of num_tokens tokens holds at once.

        Windowed groups need only the window plus one step's tokens when the
        prompt is fed max_tokens_per_step at a time; None means all at once.
        """
        return peak_pages(self._specs, num_tokens, max_tokens_per_step)

    def can_ever_fit(self, num_tokens: int, max_tokens_per_step: int | None = None) -> bool:
        """Would a request of num_tokens tokens fit into an empty pool."""
        return self.peak_pages(num_tokens, max_tokens_per_step) <= self._pool.num_usable_pages

    # ---- prefix cache --------------------------------------------------------

    def get_computed_pages(self, request: EngineRequest) -> tuple[KVCachePages, int]:
        """(cached pages per group, number of computed tokens they cover).

        Never the whole prompt: at least one token is left to compute. (empty, 0)
        when caching is off or the request wants prompt logprobs. The request's
        page hashes are kept until free(request), which a request that never
        runs (aborted while waiting) needs too.
        """
        if not self._enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self._empty, 0
        state = self._states.get(request.request_id)
        if state is None:
            state = _RequestState(self._num_groups, request.cache_salt)
            self._states[request.request_id] = state
        elif state.length:
            raise ValueError(f"request {request.request_id!r} already holds pages: look up "
                             "prefix hits only before its first allocation")
        limit = (request.num_tokens - 1) // self._ps
        self._extend_hashes(state, request.all_token_ids, limit)
        num_hit = longest_hit(self._pool, self._specs, self._windowed, state.hashes, limit)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit * self._ps
        if num_hit == 0:
            return self._empty, 0
        pages = hit_pages(self._pool, self._specs, state.hashes, num_hit)
        return KVCachePages(pages), num_hit * self._ps

    def _extend_hashes(self, state: _RequestState, token_ids: list[int], num_pages: int) -> None:
        done = len(state.hashes)
        if num_pages <= done:
            return
        ps = self._ps
        state.hashes.extend(hash_pages(
            state.hashes[-1] if done else None,
            token_ids[done * ps:num_pages * ps],
            ps,
            () if done else state.extra_keys,
        ))

    def cache_full_pages(self, request: EngineRequest, num_tokens: int) -> None:
        """Offer the request's pages that are full within its first num_tokens known tokens."""
        state = self._states.get(request.request_id)
        if state is None or not self._enable_caching:
            return
        self._cache_up_to(state, request, min(num_tokens, request.num_tokens) // self._ps)

    def _cache_up_to(self, state: _RequestState, request: EngineRequest, num_full: int) -> None:
        num_full = min(num_full, state.length)
        if num_full <= state.num_cached:
            return
        self._extend_hashes(state, request.all_token_ids, num_full)
        hashes, pool, first = state.hashes, self._pool, state.num_cached
        for g, pages in enumerate(state.pages):
            stored = [j for j in range(first, num_full)
                      if pages[j] != NULL_PAGE and pool.cache_page(g, hashes[j], pages[j])]
            if stored and pool.events.enabled:
                self._report_stored(g, stored, hashes, request)
        state.num_cached = num_full

    def _report_stored(self, group: int, stored: list[int], hashes: list[PageHash],
                       request: EngineRequest) -> None:
        """One stored event per run of consecutive pages newly in the index."""
        ps, start, token_ids = self._ps, 0, request.all_token_ids
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k] != stored[k - 1] + 1:
                a, b = stored[start], stored[k - 1] + 1
                self._pool.events.stored(group, hashes[a - 1] if a else None, hashes[a:b],
                                         token_ids[a * ps:b * ps], ps, request.cache_salt)
                start = k

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; False (nothing changes) while pages are in use."""
        return self._pool.reset_cache()

    # ---- allocation ----------------------------------------------------------

    def allocate_slots(self, request: EngineRequest, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_pages: KVCachePages | None = None,
                       num_lookahead_tokens: int = 0) -> KVCachePages | None:
        """Make room for num_computed + num_new_computed + num_new (+ lookahead) tokens.

        new_computed_pages are the prefix hits from get_computed_pages, taken on
        the request's first allocation. Pages out of a windowed group's reach are
        given back first. Returns the new page-list entries per group (hits
        excluded; windowed groups may get null entries), or None when the pages
        do not fit, and then nothing changes. Pages that become full with known
        tokens are offered to the prefix cache.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens!r}, "
                f"num_new_computed_tokens={num_new_computed_tokens!r}, "
                f"num_lookahead_tokens={num_lookahead_tokens!r}")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        end = num_computed + num_new_tokens
        if end > self._max_model_len:
            raise ValueError(
                f"request {request.request_id!r} would reach {end} tokens, beyond "
                f"max_model_len {self._max_model_len}")
        needed = -(-min(end + num_lookahead_tokens, self._max_model_len) // self._ps)
        state = self._states.get(request.request_id)
        hits = new_computed_pages.page_ids if new_computed_pages is not None else None
        if hits is not None and not any(hits):
            hits = None
        if (state is not None and hits is None and num_new_computed_tokens == 0
                and needed <= state.length):
            # Steady decode: the pages are there already; nothing new can fail to fit.
            if num_computed >= state.release_at:
                self._release_out_of_reach(state, num_computed)
                state.release_at = self._next_release(state)
            if self._enable_caching and end // self._ps > state.num_cached:
                self._cache_up_to(state, request, min(end, request.num_tokens) // self._ps)
            return self._empty
        return self._allocate_slow(request, state, hits, num_new_computed_tokens,
                                   num_computed, end, needed)

    def _next_release(self, state: _RequestState) -> int:
        """Least num_computed at which some windowed group's next entry leaves its reach."""
        soonest = self._max_model_len + 1
        for g in self._windowed:
            target = (state.nulled[g] + 1) * self._ps  # first token after that entry
            soonest = min(soonest, computed_reaching(self._specs[g], target))
        return soonest

    def _allocate_slow(self, request: EngineRequest, state: _RequestState | None,
                       hits: tuple[tuple[int, ...], ...] | None, num_new_computed: int,
                       num_computed: int, end: int, needed: int) -> KVCachePages | None:
        if hits is None and num_new_computed:
            raise ValueError(f"num_new_computed_tokens={num_new_computed} needs the prefix "
                             "hit pages from get_computed_pages as new_computed_pages")
        if hits is not None:
            self._check_hits(request, state, hits, num_new_computed)
        ps = self._ps
        base = num_new_computed // ps if hits is not None else (state.length if state else 0)
        reach = [spec.first_needed_token(num_computed) // ps for spec in self._specs]
        counts = [max(0, needed - max(base, r)) for r in reach]
        num_take = sum(counts)
        if num_take and num_take > self._room(state, reach, hits):
            return None
        if state is None:
            state = _RequestState(self._num_groups, request.cache_salt)
            self._states[request.request_id] = state
        if hits is not None:
            self._take_hits(state, hits, base)
        self._release_out_of_reach(state, num_computed)
        new_pages = self._grow(state, reach, counts, needed)
        state.release_at = self._next_release(state)
        if self._enable_caching:
            self._cache_up_to(state, request, min(end, request.num_tokens) // ps)
        return new_pages

    def _room(self, state: _RequestState | None, reach: list[int],
              hits: tuple[tuple[int, ...], ...] | None) -> int:
        """Pages this allocation could take: free ones, plus those it gives back, minus
        free cached ones it is about to share."""
        pool = self._pool
        room = pool.num_free_pages
        if state is not None:
            for g in self._windowed:
                for page_id in state.pages[g][state.nulled[g]:min(reach[g], state.length)]:
                    if page_id != NULL_PAGE and pool.ref_count(page_id) == 1:
                        room += 1
        if hits is not None:
            room -= sum(1 for group in hits for p in group if p != NULL_PAGE and pool.is_free(p))
        return room

    def _check_hits(self, request: EngineRequest, state: _RequestState | None,
                    hits: tuple[tuple[int, ...], ...], num_new_computed: int) -> None:
        rid = request.request_id
        if state is None or state.length or request.num_computed_tokens:
            raise ValueError(f"prefix hits for request {rid!r} are only taken on its first "
                             "allocation, right after get_computed_pages")
        num_hit, rest = divmod(num_new_computed, self._ps)
        if rest or len(hits) != self._num_groups or any(len(g) != num_hit for g in hits):
            raise ValueError(f"new_computed_pages {hits!r} do not cover "
                             f"num_new_computed_tokens={num_new_computed} in whole pages "
                             f"of {self._ps} tokens per group")
        if num_hit > len(state.hashes):
            raise ValueError(f"new_computed_pages of request {rid!r} go beyond its lookup")
        for g, group_hits in enumerate(hits):
            index = self._pool.cached_pages(g)
            start = self._specs[g].first_needed_token(num_new_computed) // self._ps
            for j, page_id in enumerate(group_hits):
                expected = NULL_PAGE if j < start else index.get(state.hashes[j])
                if page_id != expected:
                    raise ValueError(
                        f"prefix hit page {page_id} (group {g}, entry {j}) of request {rid!r} "
                        "is not the cached page for that content any more; call "
                        "get_computed_pages right before allocate_slots")

    def _take_hits(self, state: _RequestState, hits: tuple[tuple[int, ...], ...],
                   num_hit: int) -> None:
        self._pool.touch(p for group in hits for p in group if p != NULL_PAGE)
        for g, group_hits in enumerate(hits):
            state.pages[g].extend(group_hits)
        state.length = num_hit
        state.num_cached = num_hit

    def _release_out_of_reach(self, state: _RequestState, num_computed: int) -> None:
        """Null out and give back windowed entries the query at num_computed cannot read."""
        to_release: list[int] = []
        for g in self._windowed:
            pages, nulled = state.pages[g], state.nulled[g]
            upto = min(self._specs[g].first_needed_token(num_computed) // self._ps, state.length)
            # Oldest first, so the page furthest behind the window is evicted first.
            for j in range(nulled, upto):
                if pages[j] != NULL_PAGE:
                    to_release.append(pages[j])
                    pages[j] = NULL_PAGE
            if upto > nulled:
                state.nulled[g] = upto
        if to_release:
            self._pool.release(to_release)

    def _grow(self, state: _RequestState, reach: list[int], counts: list[int],
              needed: int) -> KVCachePages:
        if needed <= state.length:
            return self._empty
        new: list[tuple[int, ...]] = []
        for g, pages in enumerate(state.pages):
            entries = [NULL_PAGE] * (needed - state.length - counts[g])
            entries.extend(self._pool.take(counts[g], g))
            pages.extend(entries)
            if g in self._windowed:
                state.nulled[g] = max(state.nulled[g], min(reach[g], needed))
            new.append(tuple(entries))
        state.length = needed
        return KVCachePages(tuple(new))

    # ---- release and inspection -----------------------------------------------

    def free(self, request: EngineRequest) -> None:
        """Give back all of the request's pages, tail first; a no-op when it holds none."""
        state = self._states.pop(request.request_id, None)
        if state is None or not state.length:
            return
        pages = state.pages
        if self._num_groups == 1:
            order = [p for p in reversed(pages[0]) if p != NULL_PAGE]
        else:
            order = [p for j in range(state.length - 1, -1, -1) for group in pages
                     if (p := group[j]) != NULL_PAGE]
        self._pool.release(order)

    def get_pages(self, request_id: str) -> KVCachePages:
        """All page-list entries the request holds now (empty for an unknown id)."""
        state = self._states.get(request_id)
        if state is None:
            return self._empty
        return KVCachePages(tuple(tuple(pages) for pages in state.pages))

    def get_num_common_prefix_pages(self, request_id: str,
                                    num_running_requests: int) -> tuple[int, ...]:
        """Leading pages per group held by all num_running_requests running requests.

        Windowed groups report 0: their leading entries are given back early.
        """
        state = self._states.get(request_id)
        counts: list[int] = []
        for g, spec in enumerate(self._specs):
            num = 0
            if state is not None and not _is_windowed(spec):
                for page_id in state.pages[g]:
                    if self._pool.ref_count(page_id) != num_running_requests:
                        break
                    num += 1
            counts.append(num)
        return tuple(counts)
