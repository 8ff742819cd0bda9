import pytest

from esurge.core import KVCacheManager, KVCachePages
from tests.core.helpers import (
    decode_step,
    full,
    groups_config,
    manager,
    prefill,
    request,
    sliding,
)


def pool_snapshot(kv: KVCacheManager, *request_ids: str) -> tuple:
    pool = kv.pool
    return (
        pool.free_page_ids(),
        [pool.ref_count(p) for p in range(pool.num_pages)],
        [pool.page_hash(p) for p in range(pool.num_pages)],
        [kv.get_pages(r) for r in request_ids],
    )


def test_first_allocation_hands_out_pages_from_one():
    kv = manager(10, full(4))
    req = request("a", list(range(10)))
    assert kv.get_computed_pages(req) == (KVCachePages.empty(1), 0)
    assert kv.allocate_slots(req, 10) == KVCachePages(((1, 2, 3),))
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3),))
    assert kv.num_usable_pages == 9
    assert kv.num_free_pages == 6
    assert kv.usage == pytest.approx(3 / 9)


def test_decode_takes_a_new_page_only_at_a_page_boundary():
    kv = manager(10, full(4))
    req = request("a", list(range(10)))
    prefill(kv, req, sampled=100)
    assert kv.allocate_slots(req, 1) == KVCachePages.empty(1)  # position 10
    req.num_computed_tokens += 1
    req.append_output_token_ids([101])
    assert kv.allocate_slots(req, 1) == KVCachePages.empty(1)  # position 11
    req.num_computed_tokens += 1
    req.append_output_token_ids([102])
    assert kv.allocate_slots(req, 1) == KVCachePages(((4,),))  # position 12
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3, 4),))


def test_prefix_hit_shares_full_pages_and_counts_tokens():
    kv = manager(10, full(4))
    a = request("a", list(range(10)))
    prefill(kv, a)
    b = request("b", [*range(10), 50, 51])
    hits, num_hit = kv.get_computed_pages(b)
    assert (hits, num_hit) == (KVCachePages(((1, 2),)), 8)
    assert kv.prefix_cache_queries == 10 + 12
    assert kv.prefix_cache_hits == 8
    assert kv.allocate_slots(b, 4, num_hit, hits) == KVCachePages(((4,),))
    assert kv.get_pages("b") == KVCachePages(((1, 2, 4),))
    assert [kv.pool.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kv.get_num_common_prefix_pages("b", 2) == (2,)
    kv.free(a)
    kv.free(b)
    assert kv.usage == 0.0
    assert kv.num_free_pages == 9


def test_a_fully_cached_prompt_still_recomputes_its_last_page():
    kv = manager(10, full(4))
    prefill(kv, request("a", list(range(8))))
    b = request("b", list(range(8)))
    hits, num_hit = kv.get_computed_pages(b)
    assert (hits, num_hit) == (KVCachePages(((1,),)), 4)
    assert kv.allocate_slots(b, 4, num_hit, hits) == KVCachePages(((3,),))
    # Same content as page 2: the index keeps the first copy only.
    assert kv.pool.page_hash(3) is None


def test_free_returns_pages_tail_first_so_eviction_takes_tails_first():
    kv = manager(7, full(4))
    a = request("a", list(range(12)))
    prefill(kv, a)
    kv.free(a)
    assert kv.pool.free_page_ids() == [4, 5, 6, 3, 2, 1]
    kv.free(a)  # idempotent
    assert kv.pool.free_page_ids() == [4, 5, 6, 3, 2, 1]
    prefill(kv, request("c", list(range(100, 116))))  # 4 pages: 4, 5, 6 and a's tail 3
    assert kv.get_pages("c") == KVCachePages(((4, 5, 6, 3),))
    b = request("b", [*range(12), 7])
    assert kv.get_computed_pages(b) == (KVCachePages(((1, 2),)), 8)


def test_requests_with_different_cache_salts_never_share_pages():
    kv = manager(20, full(4))
    prefill(kv, request("a", list(range(9)), cache_salt="t1"))
    assert kv.get_computed_pages(request("b", list(range(9)), cache_salt="t2"))[1] == 0
    assert kv.get_computed_pages(request("c", list(range(9))))[1] == 0
    assert kv.get_computed_pages(request("d", list(range(9)), cache_salt="t1")) == (
        KVCachePages(((1, 2),)), 8)


def test_reset_prefix_cache_is_refused_while_pages_are_in_use():
    kv = manager(10, full(4))
    a = request("a", list(range(9)))
    prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_pages(request("b", list(range(9))))[1] == 8
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.num_cached_pages() == 0
    assert kv.get_computed_pages(request("c", list(range(9))))[1] == 0


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing():
    kv = manager(6, full(4))
    prefill(kv, request("a", list(range(12))))
    b = request("b", list(range(100, 112)))
    kv.get_computed_pages(b)
    before = pool_snapshot(kv, "a", "b")
    assert kv.allocate_slots(b, 12) is None
    assert pool_snapshot(kv, "a", "b") == before


def test_prefix_hits_on_free_pages_count_against_the_room_left():
    kv = manager(6, full(4))
    a = request("a", list(range(16)))
    prefill(kv, a)
    kv.free(a)
    b = request("b", [*range(12), *range(100, 112)])  # 6 pages: 3 hits, 3 new
    hits, num_hit = kv.get_computed_pages(b)
    assert (hits, num_hit) == (KVCachePages(((1, 2, 3),)), 12)
    before = pool_snapshot(kv, "b")
    # 5 pages are free, but 3 of them are the hits themselves: 2 left for 3 new ones.
    assert kv.allocate_slots(b, 12, num_hit, hits) is None
    assert pool_snapshot(kv, "b") == before
    c = request("c", [*range(12), *range(100, 108)])  # 5 pages: 3 hits, 2 new
    hits, num_hit = kv.get_computed_pages(c)
    assert kv.allocate_slots(c, 8, num_hit, hits) == KVCachePages(((5, 4),))
    assert kv.num_free_pages == 0


def test_caching_off_finds_nothing_and_caches_nothing():
    kv = manager(10, full(4), enable_caching=False)
    prefill(kv, request("a", list(range(9))))
    assert kv.get_computed_pages(request("b", list(range(9)))) == (KVCachePages.empty(1), 0)
    assert kv.pool.num_cached_pages() == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


def test_prompt_logprobs_requests_get_no_prefix_hits():
    kv = manager(10, full(4))
    prefill(kv, request("a", list(range(9))))
    queries = kv.prefix_cache_queries
    b = request("b", list(range(9)), prompt_logprobs=1)
    assert kv.get_computed_pages(b) == (KVCachePages.empty(1), 0)
    assert kv.prefix_cache_queries == queries


def test_lookahead_slots_are_allocated_up_to_max_model_len():
    kv = manager(10, full(4), max_model_len=8)
    a = request("a", list(range(5)))
    assert kv.allocate_slots(a, 5, num_lookahead_tokens=2) == KVCachePages(((1, 2),))
    b = request("b", list(range(5)))
    assert kv.allocate_slots(b, 5, num_lookahead_tokens=6) == KVCachePages(((3, 4),))


def test_cache_full_pages_caches_pages_whose_tokens_became_known():
    kv = manager(10, full(4))
    a = request("a", [1, 2, 3, 4])
    # Async scheduling: page 2 is written by the step before its tokens are known.
    assert kv.allocate_slots(a, 4, num_lookahead_tokens=4) == KVCachePages(((1, 2),))
    assert kv.pool.page_hash(2) is None
    a.append_output_token_ids([7, 7, 7, 7])
    a.num_computed_tokens = 8
    kv.cache_full_pages(a, 8)
    assert kv.pool.page_hash(2) is not None
    b = request("b", [1, 2, 3, 4, 7, 7, 7, 7, 9])
    assert kv.get_computed_pages(b) == (KVCachePages(((1, 2),)), 8)


def test_stale_prefix_hits_are_refused():
    kv = manager(4, full(4))
    a = request("a", list(range(9)))
    prefill(kv, a)
    kv.free(a)
    b = request("b", list(range(9)))
    hits, num_hit = kv.get_computed_pages(b)
    assert hits == KVCachePages(((1, 2),))
    prefill(kv, request("c", list(range(100, 112))))  # evicts pages 1 and 2
    with pytest.raises(ValueError, match="not the cached page for that content"):
        kv.allocate_slots(b, 1, num_hit, hits)
    assert kv.get_pages("b") == KVCachePages.empty(1)


def test_misuse_raises_value_errors():
    kv = manager(10, full(4), max_model_len=16)
    a = request("a", list(range(9)))
    with pytest.raises(ValueError, match="reach 17 tokens, beyond max_model_len 16"):
        kv.allocate_slots(a, 17)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        kv.allocate_slots(a, -1)
    with pytest.raises(ValueError, match="needs the prefix hit pages"):
        kv.allocate_slots(a, 1, num_new_computed_tokens=8)
    prefill(kv, a)
    with pytest.raises(ValueError, match="already holds pages"):
        kv.get_computed_pages(a)
    with pytest.raises(ValueError, match="max_model_len must be an int >= 1, got 0"):
        KVCacheManager(groups_config(10, full(4)), 0)
    with pytest.raises(ValueError, match="num_pages must be an int >= 2"):
        KVCacheManager(groups_config(1, full(4)), 16)
    with pytest.raises(ValueError, match="kv_cache_config must be a CacheGroupsConfig"):
        KVCacheManager("pages", 16)  # type: ignore[arg-type]


def test_size_queries():
    kv = manager(10, full(4), max_model_len=30)
    assert kv.max_pages_per_request() == 8
    assert kv.can_ever_fit(36) and not kv.can_ever_fit(37)
    hybrid = manager(10, full(4), sliding(4, 5))
    assert hybrid.can_ever_fit(16)  # 4 + 4 pages
    assert not hybrid.can_ever_fit(20)  # 5 + 5 pages at once
    # Fed 4 tokens a step, the window group holds at most 3 pages.
    assert hybrid.can_ever_fit(20, max_tokens_per_step=4)
    assert hybrid.peak_pages(20, max_tokens_per_step=4) == 8


def test_kv_cache_pages_helpers():
    assert KVCachePages.empty(2).is_empty()
    assert not KVCachePages(((), (0,))).is_empty()
    assert KVCachePages(((1,), (2,))) + KVCachePages(((3,), ())) == KVCachePages(((1, 3), (2,)))
    with pytest.raises(ValueError, match="pages of 1 and 2 groups"):
        KVCachePages(((1,),)) + KVCachePages.empty(2)


def test_decode_steps_keep_state_consistent_over_many_pages():
    kv = manager(40, full(4))
    a = request("a", [1, 2, 3])
    prefill(kv, a, sampled=0)
    for step in range(40):
        decode_step(kv, a, step)
    assert kv.get_pages("a") == KVCachePages((tuple(range(1, 12)),))
    # Every page full with known tokens is findable.
    b = request("b", list(a.all_token_ids))
    assert kv.get_computed_pages(b)[1] == 40
