import math
from types import SimpleNamespace

from esurge.core import KVCacheManager, KVCachePages, cache_groups_from_hf_config
from esurge.core.page_budget import computed_reaching
from tests.core.helpers import (
    chunked,
    decode_step,
    full,
    held_pages,
    manager,
    prefill,
    request,
    sliding,
)


def test_sliding_window_gives_back_pages_that_left_the_window():
    # Window 5: the query at position p reads p-4..p.
    kv = manager(10, full(4), sliding(4, 5))
    a = request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) == KVCachePages(((1, 2, 3), (4, 5, 6)))
    a.num_computed_tokens = 10
    a.append_output_token_ids([100])
    # The query at 10 reads 6..10: page 0 (tokens 0..3) is out.
    assert kv.allocate_slots(a, 1) == KVCachePages.empty(2)
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3), (0, 5, 6)))
    assert kv.pool.free_page_ids() == [7, 8, 9, 4]
    a.num_computed_tokens = 11
    a.append_output_token_ids([101])
    # The query at 11 reads 7..11: page 1 (4..7) is still needed.
    assert kv.allocate_slots(a, 1) == KVCachePages.empty(2)
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3), (0, 5, 6)))
    a.num_computed_tokens = 12
    a.append_output_token_ids([102])
    # The query at 12 reads 8..12: page 1 goes, page 3 is new in both groups.
    assert kv.allocate_slots(a, 1) == KVCachePages(((7,), (8,)))
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3, 7), (0, 0, 6, 8)))
    assert kv.pool.free_page_ids() == [9, 4, 5]
    kv.free(a)
    assert kv.num_free_pages == 9


def test_pages_behind_the_window_go_back_on_the_step_after_a_long_prefill():
    kv = manager(20, sliding(4, 5))
    a = request("a", list(range(30)))
    # One step writes all 30 positions, so all 8 pages exist during it.
    assert kv.allocate_slots(a, 30) == KVCachePages(((1, 2, 3, 4, 5, 6, 7, 8),))
    a.num_computed_tokens = 30
    a.append_output_token_ids([1])
    # The query at 30 reads 26..30: pages 6 and 7 stay, 0..5 go back oldest first.
    assert kv.allocate_slots(a, 1) == KVCachePages.empty(1)
    assert kv.get_pages("a") == KVCachePages(((0, 0, 0, 0, 0, 0, 7, 8),))
    assert kv.pool.free_page_ids()[-6:] == [1, 2, 3, 4, 5, 6]
    assert kv.num_free_pages == 19 - 2


def test_sliding_window_memory_is_bounded_by_the_window_not_the_sequence():
    page_size, window = 4, 10
    # 7 usable pages: a full-attention cache would need 250 for 1000 tokens.
    kv = manager(8, sliding(page_size, window), max_model_len=1024)
    a = request("a", list(range(8)))
    prefill(kv, a, sampled=0)
    bound = math.ceil(window / page_size) + 1
    most = 0
    for step in range(1000 - a.num_tokens):
        decode_step(kv, a, step % 50)
        held = held_pages(kv, "a", 0)
        most = max(most, len(held))
        assert len(held) <= bound
        assert kv.usage <= bound / 7
    assert most == bound
    assert a.num_computed_tokens == 999
    assert len(kv.get_pages("a").page_ids[0]) == 250


def test_chunked_local_group_gives_back_pages_of_past_chunks():
    kv = manager(10, full(4), chunked(4, 8))
    a = request("a", list(range(7)))
    prefill(kv, a, sampled=7)
    assert kv.get_pages("a") == KVCachePages(((1, 2), (3, 4)))
    decode_step(kv, a, 8)  # position 7, still chunk 0
    assert kv.get_pages("a") == KVCachePages(((1, 2), (3, 4)))
    # Position 8 opens chunk 1: chunk 0's pages are no longer read.
    assert kv.allocate_slots(a, 1) == KVCachePages(((5,), (6,)))
    assert kv.get_pages("a") == KVCachePages(((1, 2, 5), (0, 0, 6)))
    assert kv.pool.free_page_ids() == [7, 8, 9, 3, 4]


def test_hybrid_hit_is_as_long_as_the_window_group_allows():
    kv = manager(12, sliding(4, 5), full(4))
    a = request("a", list(range(17)))
    prefill(kv, a)
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3, 4, 5), (6, 7, 8, 9, 10)))
    kv.free(a)
    # Tail first, position by position, sliding before full.
    assert kv.pool.free_page_ids() == [11, 5, 10, 4, 9, 3, 8, 2, 7, 1, 6]
    prefill(kv, request("c", list(range(100, 105))))  # sliding 11, 5; full 10, 4
    assert kv.get_pages("c") == KVCachePages(((11, 5), (10, 4)))
    b = request("b", [*range(17), 1])
    # The full group still has pages 0..3, but a 16-token prefix needs sliding page 3
    # (evicted); a 12-token one needs only sliding page 2 (the query at 12 reads 8..12).
    assert kv.get_computed_pages(b) == (KVCachePages(((0, 0, 3), (6, 7, 8))), 12)


def test_hybrid_hit_does_not_need_sliding_pages_outside_the_window():
    kv = manager(14, full(4), sliding(4, 5))
    a = request("a", list(range(17)))
    prefill(kv, a, sampled=0)
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3, 4, 5), (6, 7, 8, 9, 10)))
    decode_step(kv, a, 1)  # the query at 17 reads 13..17: sliding pages 0..2 go back
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3, 4, 5), (0, 0, 0, 9, 10)))
    assert kv.pool.free_page_ids() == [11, 12, 13, 6, 7, 8]
    c = request("c", list(range(100, 112)))
    prefill(kv, c)  # evicts the cached sliding pages 6, 7, 8
    assert kv.get_pages("c") == KVCachePages(((11, 12, 13), (6, 7, 8)))
    b = request("b", [*range(17), 0])
    hits, num_hit = kv.get_computed_pages(b)
    assert (hits, num_hit) == (KVCachePages(((1, 2, 3, 4), (0, 0, 0, 9))), 16)
    assert kv.allocate_slots(b, 2, num_hit, hits) is None  # the pool is full
    kv.free(c)
    assert kv.pool.free_page_ids() == [13, 8, 12, 7, 11, 6]
    hits, num_hit = kv.get_computed_pages(b)
    assert kv.allocate_slots(b, 2, num_hit, hits) == KVCachePages(((13,), (8,)))
    assert kv.get_pages("b") == KVCachePages(((1, 2, 3, 4, 13), (0, 0, 0, 9, 8)))
    assert [kv.pool.ref_count(p) for p in (1, 2, 3, 4, 9)] == [2] * 5


def test_chunked_local_hit_needs_only_the_current_chunk():
    kv = manager(20, full(4), chunked(4, 8))
    a = request("a", list(range(21)))
    prefill(kv, a)
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)))
    b = request("b", [*range(20), 9, 9])
    # 20 tokens: the query at 20 reads chunk 16..23, i.e. page 4 only.
    assert kv.get_computed_pages(b) == (
        KVCachePages(((1, 2, 3, 4, 5), (0, 0, 0, 0, 11))), 20)


def test_groups_built_from_a_model_config_share_one_pool():
    hf_config = SimpleNamespace(
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
        head_dim=8, sliding_window=6, attention_chunk_size=None,
        layer_types=["sliding_attention", "full_attention"] * 2)
    kv = KVCacheManager(cache_groups_from_hf_config(hf_config, num_pages=12, page_size=4), 64)
    assert kv.num_groups == 2
    a = request("a", list(range(14)))
    prefill(kv, a, sampled=0)
    # Group order follows the first layer of each type: sliding (0, 2), full (1, 3).
    assert kv.get_pages("a") == KVCachePages(((1, 2, 3, 4), (5, 6, 7, 8)))
    decode_step(kv, a, 0)  # the query at 14 reads 9..14: sliding page 0 and 1 go back
    assert kv.get_pages("a") == KVCachePages(((0, 0, 3, 4), (5, 6, 7, 8)))


def test_release_points_match_first_needed_token():
    # The manager skips window bookkeeping until num_computed reaches this point.
    for spec in (sliding(4, 1), sliding(4, 5), sliding(4, 9), chunked(4, 4), chunked(4, 8)):
        for token in range(1, 40):
            at = computed_reaching(spec, token)
            assert spec.first_needed_token(at) >= token > spec.first_needed_token(at - 1)


def test_a_shared_page_leaving_the_window_does_not_count_as_room():
    kv = manager(6, sliding(4, 5))
    a = request("a", list(range(9)))
    prefill(kv, a, sampled=100)
    b = request("b", [*range(9), 9])
    assert prefill(kv, b) == 8  # shares a's page 2 (tokens 4..7)
    assert kv.get_pages("b") == KVCachePages(((0, 2, 4),))
    for token in (101, 102, 103):
        decode_step(kv, a, token)  # the first step gives back a's page 1
    prefill(kv, request("c", list(range(50, 58))))  # takes the last free pages 5 and 1
    assert kv.num_free_pages == 0
    # The query at 12 no longer reads page 2, but b still holds it: no room for page 3.
    before = (kv.pool.free_page_ids(), kv.get_pages("a"), kv.pool.ref_count(2))
    assert kv.allocate_slots(a, 1) is None
    assert (kv.pool.free_page_ids(), kv.get_pages("a"), kv.pool.ref_count(2)) == before
    kv.free(b)
    assert kv.allocate_slots(a, 1) == KVCachePages(((4,),))
    assert kv.get_pages("a") == KVCachePages(((0, 0, 3, 4),))
    assert kv.pool.free_page_ids() == [2]


def test_cache_specs_are_siblings() -> None:
    from esurge.core import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(8, 2, 16)
    window = SlidingWindowSpec(8, 2, 16, sliding_window=32)
    chunk = ChunkedLocalAttentionSpec(8, 2, 16, attention_chunk_size=64)
    assert all(isinstance(s, AttentionSpec) for s in (full, window, chunk))
    assert not isinstance(window, FullAttentionSpec) and not isinstance(chunk, FullAttentionSpec)
    assert [s.first_needed_token(100) for s in (full, window, chunk)] == [0, 69, 64]
    assert full.page_bytes == window.page_bytes == 2 * 8 * 2 * 16 * 4
