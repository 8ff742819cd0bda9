"""Random interleavings of lookup / allocate / free / reset against a simulated device.

The machine plays a tiny scheduler and model: every token it schedules is
"written" into a fake KV store (page, offset) as the exact context it stands
for, and every step checks that each running request can still read the right
context for all positions its next query attends to, in every group. Shared
pages, eviction, windows, salts and preemption all have to keep that true.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from esurge.core import FullAttentionSpec, KVCacheManager, KVCachePages
from esurge.request import EngineRequest
from tests.core.helpers import chunked, full, manager, request, sliding

PREFIXES: tuple[list[int], ...] = (
    [],
    [1, 2, 3, 1, 2, 3, 1, 2],
    [1, 2, 3, 1, 2, 3, 1, 2, 0, 0, 0, 0, 0, 0],
    [1, 2, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
)
MAX_LEN = 40
MAX_REQUESTS = 5

Context = tuple[str | None, tuple[int, ...]]


class KVCacheMachine(RuleBasedStateMachine):
    specs: tuple[FullAttentionSpec, ...] = (full(4), sliding(4, 5), chunked(4, 8))
    num_pages = 30

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager = manager(self.num_pages, *self.specs, max_model_len=MAX_LEN)
        self.ps = self.kv.page_size
        self.reqs: dict[str, EngineRequest] = {}
        self.device: dict[tuple[int, int], Context] = {}  # (page, offset) -> context
        self.next_id = 0

    # ---- helpers ---------------------------------------------------------------

    def context(self, req: EngineRequest, pos: int) -> Context:
        return req.cache_salt, tuple(req.all_token_ids[:pos + 1])

    def check_readable(self, req: EngineRequest, pages: KVCachePages, num_computed: int,
                       out_of_reach_given_back: bool) -> None:
        """The next query (at num_computed) finds its whole reach, in every group.

        Pages out of reach are given back on the request's next allocation, so
        right after a lookup or an allocation they must be null entries.
        """
        for g, spec in enumerate(self.specs):
            group = pages.page_ids[g]
            reach = spec.first_needed_token(num_computed)
            if out_of_reach_given_back:
                assert all(p == 0 for p in group[:reach // self.ps])
            for pos in range(reach, num_computed):
                page = group[pos // self.ps]
                assert page != 0
                assert self.device[(page, pos % self.ps)] == self.context(req, pos)

    def snapshot(self) -> tuple:
        pool = self.kv.pool
        return (pool.free_page_ids(),
                [(pool.ref_count(p), pool.page_hash(p)) for p in range(pool.num_pages)],
                {rid: self.kv.get_pages(rid) for rid in self.reqs})

    def holds_pages(self, rid: str) -> bool:
        return any(self.kv.get_pages(rid).page_ids)

    # ---- rules -----------------------------------------------------------------

    @rule(prefix=st.sampled_from(range(len(PREFIXES))),
          suffix=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          salt=st.sampled_from([None, "tenant"]))
    def add_request(self, prefix: int, suffix: list[int], salt: str | None) -> None:
        if len(self.reqs) >= MAX_REQUESTS:
            self.finish_request(min(self.reqs, key=lambda r: int(r[1:])))
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = request(rid, PREFIXES[prefix] + suffix, cache_salt=salt)

    @rule(steps=st.lists(st.tuples(st.integers(0, MAX_REQUESTS - 1), st.integers(1, 12),
                                    st.integers(0, 3), st.integers(0, 3)),
                          min_size=1, max_size=6))
    def run_steps(self, steps: list[tuple[int, int, int, int]]) -> None:
        for pick, chunk, lookahead, token in steps:
            if self.reqs:
                self.step(pick, chunk, lookahead, token)

    def step(self, pick: int, chunk: int, lookahead: int, token: int) -> None:
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        req = self.reqs[rid]
        hits, num_hit = None, 0
        if not self.holds_pages(rid):
            hits, num_hit = self.kv.get_computed_pages(req)
            assert num_hit % self.ps == 0 and num_hit < req.num_tokens
            self.check_readable(req, hits, num_hit, out_of_reach_given_back=True)
        start = req.num_computed_tokens + num_hit
        num_new = min(chunk, req.num_tokens - start)
        before = self.snapshot()
        new = self.kv.allocate_slots(req, num_new, num_hit, hits, lookahead)
        if new is None:
            assert self.snapshot() == before
            self.kv.free(req)  # preempted: recompute from scratch later
            req.num_computed_tokens = 0
            return
        pages = self.kv.get_pages(rid)
        self.check_readable(req, pages, start, out_of_reach_given_back=True)
        for g in range(len(self.specs)):
            for pos in range(start, start + num_new):
                page = pages.page_ids[g][pos // self.ps]
                assert page != 0 and self.kv.pool.ref_count(page) == 1  # never write shared
                self.device[(page, pos % self.ps)] = self.context(req, pos)
        req.num_computed_tokens = start + num_new
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= MAX_LEN:
                self.finish_request(rid)
            else:
                req.append_output_token_ids([token])

    @rule(pick=st.integers(0, MAX_REQUESTS - 1))
    def finish(self, pick: int) -> None:
        if self.reqs:
            self.finish_request(sorted(self.reqs)[pick % len(self.reqs)])

    def finish_request(self, rid: str) -> None:
        pool = self.kv.pool
        held = [p for group in self.kv.get_pages(rid).page_ids for p in group if p]
        refs = Counter({p: pool.ref_count(p) for p in held})
        self.kv.free(self.reqs.pop(rid))
        for page in held:
            assert pool.ref_count(page) == refs[page] - 1
            assert pool.is_free(page) == (refs[page] == 1)
        assert self.kv.get_pages(rid) == KVCachePages.empty(len(self.specs))

    @rule(roll=st.integers(0, 7))
    def reset(self, roll: int) -> None:
        if roll:  # rare: a reset wipes the prefix cache the other rules build up
            return
        idle = self.kv.num_free_pages == self.kv.num_usable_pages
        assert self.kv.reset_prefix_cache() is idle
        if idle:
            assert self.kv.pool.num_cached_pages() == 0

    # ---- invariants ------------------------------------------------------------

    @invariant()
    def pages_are_owned_consistently(self) -> None:
        pool = self.kv.pool
        owners: Counter[int] = Counter()
        group_of: dict[int, int] = {}
        for rid in self.reqs:
            own: list[int] = []
            for g, group in enumerate(self.kv.get_pages(rid).page_ids):
                for page in group:
                    if page:
                        assert group_of.setdefault(page, g) == g  # one group per page
                        own.append(page)
            assert len(own) == len(set(own))  # a request holds a page once
            owners.update(own)
        assert pool.ref_count(0) == 0 and not pool.is_free(0)
        for page in range(1, pool.num_pages):
            assert pool.ref_count(page) == owners[page] >= 0
            assert pool.is_free(page) == (owners[page] == 0)
            if owners[page] > 1:
                assert pool.page_hash(page) is not None  # only cached pages are shared
        assert pool.num_free_pages + len(owners) == pool.num_usable_pages

    @invariant()
    def running_requests_read_the_right_context(self) -> None:
        for rid, req in self.reqs.items():
            if self.holds_pages(rid):
                self.check_readable(req, self.kv.get_pages(rid), req.num_computed_tokens,
                                    out_of_reach_given_back=False)

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.finish_request(rid)
        assert self.kv.num_free_pages == self.kv.num_usable_pages
        assert self.kv.usage == 0.0


class FullOnlyMachine(KVCacheMachine):
    specs = (full(2), full(2))
    num_pages = 24


class WindowOnlyMachine(KVCacheMachine):
    specs = (sliding(2, 3),)
    num_pages = 9


_SETTINGS = settings(derandomize=True, max_examples=60, stateful_step_count=40, deadline=None)

TestHybridGroups = KVCacheMachine.TestCase
TestHybridGroups.settings = _SETTINGS
TestFullGroups = FullOnlyMachine.TestCase
TestFullGroups.settings = _SETTINGS
TestWindowGroup = WindowOnlyMachine.TestCase
TestWindowGroup.settings = _SETTINGS
