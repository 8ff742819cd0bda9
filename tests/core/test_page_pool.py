import pytest

from esurge.core import PagePool


def test_fresh_pool_hands_out_pages_in_order_and_never_the_null_page():
    pool = PagePool(5)
    assert pool.num_usable_pages == 4
    assert pool.free_page_ids() == [1, 2, 3, 4]
    assert pool.take(4, group=0) == [1, 2, 3, 4]
    assert pool.num_free_pages == 0
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="cannot take 1 pages: only 0 are free"):
        pool.take(1, group=0)


def test_release_appends_to_the_back_in_the_given_order():
    pool = PagePool(7)
    pool.take(3, group=0)  # 1, 2, 3
    pool.release([3, 1])
    assert pool.free_page_ids() == [4, 5, 6, 3, 1]
    assert pool.ref_count(2) == 1 and pool.ref_count(3) == 0
    assert pool.take(5, group=0) == [4, 5, 6, 3, 1]


def test_a_cached_page_stays_findable_until_it_is_evicted():
    pool = PagePool(4, num_groups=2)
    a, b = pool.take(2, group=1)
    assert pool.cache_page(1, b"h" * 16, a)
    pool.release([b, a])  # tail first
    assert pool.cached_pages(1) == {b"h" * 16: a}
    assert pool.cached_pages(0) == {}
    # Hand out the untouched page 3 and then b: a is still cached.
    assert pool.take(2, group=0) == [3, b]
    assert pool.page_hash(a) == b"h" * 16
    assert pool.take(1, group=0) == [a]
    assert pool.cached_pages(1) == {}
    assert pool.page_hash(a) is None


def test_touch_shares_a_held_page_and_revives_a_free_cached_one():
    pool = PagePool(4)
    (page,) = pool.take(1, group=0)
    pool.cache_page(0, b"x" * 16, page)
    pool.touch([page])
    assert pool.ref_count(page) == 2
    pool.release([page, page])
    assert pool.is_free(page)
    pool.touch([page])
    assert not pool.is_free(page)
    assert pool.free_page_ids() == [2, 3]


def test_one_content_is_cached_once_per_group():
    pool = PagePool(4)
    a, b = pool.take(2, group=0)
    assert pool.cache_page(0, b"x" * 16, a)
    assert not pool.cache_page(0, b"x" * 16, b)
    assert not pool.cache_page(0, b"y" * 16, a)
    assert pool.page_hash(b) is None
    assert pool.num_cached_pages() == 1


def test_reset_cache_is_refused_while_pages_are_held():
    pool = PagePool(4)
    (page,) = pool.take(1, group=0)
    pool.cache_page(0, b"x" * 16, page)
    assert not pool.reset_cache()
    assert pool.page_hash(page) == b"x" * 16
    pool.release([page])
    assert pool.reset_cache()
    assert pool.page_hash(page) is None
    assert pool.cached_pages(0) == {}


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="num_pages must be an int >= 2"):
        PagePool(1)
    pool = PagePool(4)
    with pytest.raises(ValueError, match="page 1 is not held"):
        pool.release([1])
    with pytest.raises(ValueError, match="null page"):
        pool.touch([0])
    with pytest.raises(ValueError, match="free and not cached"):
        pool.touch([2])
    with pytest.raises(ValueError, match="not held: only held pages can be cached"):
        pool.cache_page(0, b"x" * 16, 3)
    with pytest.raises(ValueError, match=r"page_id must be in \[0, 4\), got 9"):
        pool.ref_count(9)
