"""BlockManager: reference counts, the free list and the prefix cache, driven the way the scheduler
drives them (get_computed_blocks -> allocate_slots -> compute -> cache_full_blocks -> free).

The stateful test keeps a model of what each KV slot holds (the token prefix whose K/V was written
there), so a prefix hit on a block with other contents, or a write into a block another request or the
cache still relies on, fails at once. Pure Python: no torch here.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pdserve.kv.block_manager import BlockManager, hash_block
from pdserve.request import Request, RequestStatus, SamplingParams

_ids = itertools.count()


def make_req(tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=1000)
    return Request(req_id=f"r{next(_ids)}", prompt_token_ids=list(tokens), params=params)


def admit(bm: BlockManager, req: Request, num_tokens: int | None = None) -> list[int]:
    """Admit like the scheduler: consult the prefix cache, then allocate for `num_tokens` (all)."""
    hits = bm.get_computed_blocks(req)
    ok = bm.allocate_slots(req, req.num_tokens if num_tokens is None else num_tokens, hits)
    assert ok
    req.num_computed_tokens = len(hits) * bm.block_size
    return hits


def compute_all(bm: BlockManager, req: Request) -> None:
    """Pretend the forward ran over every allocated-for token, then register the full blocks."""
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


# ---- plain unit tests ------------------------------------------------------------------------------


def test_prefix_hit_reuses_and_shares_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_req(list(range(1, 10)))  # 9 tokens: 2 full blocks + 1
    assert admit(bm, a) == []
    compute_all(bm, a)
    b = make_req(list(range(1, 10)) + [42, 43])
    hits = admit(bm, b)
    assert hits == a.block_ids[:2]
    assert b.block_ids[:2] == a.block_ids[:2]
    assert b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in hits] == [2, 2]
    assert set(b.block_ids[2:]).isdisjoint(a.block_ids)  # its own tail, never a's partial block
    assert bm.ref_counts[a.block_ids[2]] == 1
    bm.check_invariants([a, b])
    bm.free(a)
    assert [bm.ref_counts[x] for x in hits] == [1, 1]  # still held by b, so not free
    assert bm.num_free_blocks == 16 - len(b.block_ids)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 16


@pytest.mark.parametrize("length, expected_hits", [(8, 1), (9, 2), (5, 1), (4, 0), (1, 0)])
def test_hit_never_covers_the_last_token(length: int, expected_hits: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_req(list(range(1, 13)))  # 3 full blocks, all cached
    admit(bm, a)
    compute_all(bm, a)
    b = make_req(list(range(1, 1 + length)))  # a prefix of a, fully cached
    hits = bm.get_computed_blocks(b)
    assert len(hits) == expected_hits
    assert len(hits) * bm.block_size < b.num_tokens  # at least one token left to compute


def test_hit_counts_output_tokens_of_a_recomputed_request() -> None:
    bm = BlockManager(num_blocks=16, block_size=2)
    a = make_req([1, 2, 3])
    admit(bm, a)
    a.output_token_ids += [4, 5, 6]  # decoded three tokens; K/V of all but the last are computed
    assert bm.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens - 1
    bm.cache_full_blocks(a)
    blocks = list(a.block_ids)
    bm.free(a)  # preempted
    a.num_computed_tokens = 0
    hits = bm.get_computed_blocks(a)
    assert hits == blocks[:2]  # tokens 1..4 cached; 5,6 sit in a block whose 6 was never computed


def test_evicted_blocks_are_no_longer_hit() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_req([1, 2, 3, 4, 5])  # 3 blocks: [1 2] [3 4] cached, [5] partial
    admit(bm, a)
    compute_all(bm, a)
    head, tail = a.block_ids[:2]
    bm.free(a)
    probe = [1, 2, 3, 4, 9]
    assert bm.get_computed_blocks(make_req(probe)) == [head, tail]
    # Two new blocks: the never-used block and a's partial block (uncached) go first, nothing evicted.
    b = make_req([7, 7, 7, 7])
    admit(bm, b)
    assert bm.get_computed_blocks(make_req(probe)) == [head, tail]
    # One more block must come from the cached ones: the tail [3 4] goes before the head [1 2].
    c = make_req([8, 8])
    admit(bm, c)
    assert c.block_ids == [tail]
    assert bm.get_computed_blocks(make_req(probe)) == [head]
    d = make_req([9, 9])
    admit(bm, d)
    assert d.block_ids == [head]
    assert bm.get_computed_blocks(make_req(probe)) == []
    bm.check_invariants([b, c, d])


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = make_req([1, 2, 3, 4, 5, 6, 7])  # 4 blocks: 3 cached, 1 partial
    admit(bm, a)
    compute_all(bm, a)
    cached = a.block_ids[:3]
    bm.free(a)
    # 3 uncached free blocks (2 never used + a's partial one): a 3-block request takes exactly those.
    b = make_req([9, 9, 9, 9, 9, 9])
    assert admit(bm, b) == []
    assert set(b.block_ids).isdisjoint(cached)
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 5, 6, 7])) == cached
    # Least recently freed first, and within a sequence the tail before the head.
    c = make_req([8, 8])
    admit(bm, c)
    assert c.block_ids == [cached[2]]
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 5, 6, 7])) == cached[:2]


def test_uncached_block_freed_last_is_still_reused_first() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_req([1, 2, 3, 4, 0])
    admit(bm, a, 4)
    compute_all(bm, a)  # 2 cached blocks
    cached = list(a.block_ids)
    b = make_req([5, 6, 0])
    admit(bm, b, 2)  # its block is never computed, so never cached
    bm.free(a)
    bm.free(b)  # freed after the cached ones, but it must still go first
    c = make_req([7])
    admit(bm, c)
    assert c.block_ids != [cached[0]] and c.block_ids != [cached[1]]
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 0])) == cached


def test_freed_blocks_are_evicted_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = make_req([1, 1, 0]), make_req([2, 2, 0])
    for r in (a, b):
        assert bm.allocate_slots(r, 2)
        r.num_computed_tokens = 2
        bm.cache_full_blocks(r)
    a_block = a.block_ids[0]
    bm.free(a)
    bm.free(b)
    c = make_req([3, 3])
    admit(bm, c)
    assert c.block_ids == [a_block]  # a was freed first
    assert bm.get_computed_blocks(make_req([1, 1, 0])) == []
    assert len(bm.get_computed_blocks(make_req([2, 2, 0]))) == 1


def test_hashes_are_chained_over_the_prefix() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_req([5, 6, 7, 8, 1, 2, 3, 4, 0])
    admit(bm, a)
    compute_all(bm, a)
    # a's second block holds [1 2 3 4], but after [5 6 7 8]: at position 0 it is other K/V.
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 0])) == []
    # The same block content after a different first block does not hit either.
    b = make_req([9, 9, 9, 9, 1, 2, 3, 4, 0])
    assert admit(bm, b) == []
    compute_all(bm, b)
    assert set(b.block_ids).isdisjoint(a.block_ids)
    # Both chains are now findable, each from its own head.
    assert bm.get_computed_blocks(make_req([5, 6, 7, 8, 1, 2, 3, 4, 7])) == a.block_ids[:2]
    assert bm.get_computed_blocks(make_req([9, 9, 9, 9, 1, 2, 3, 4, 7])) == b.block_ids[:2]
    h0 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(hash_block(None, [5, 6, 7, 8]), [1, 2, 3, 4]) != h0


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=False)
    a = make_req([1, 2, 3, 4, 5])
    assert admit(bm, a) == []
    compute_all(bm, a)
    assert bm.block_hashes == [None] * 16
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 5])) == []
    bm.free(a)
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 5])) == []
    bm.check_invariants([])


def test_reset_prefix_cache_forgets_every_hash() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = make_req([1, 2, 3, 4, 5]), make_req([6, 7, 8])
    for r in (a, b):
        admit(bm, r)
        compute_all(bm, r)
    bm.free(b)  # one chain free-but-cached, one held
    bm.reset_prefix_cache()
    assert bm.block_hashes == [None] * 8
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 5])) == []
    assert bm.get_computed_blocks(make_req([6, 7, 8])) == []
    bm.free(a)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


def test_allocate_is_all_or_nothing_counting_revived_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_req([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)  # 2 cached free blocks + 2 uncached free blocks
    hog = make_req([9, 9])
    admit(bm, hog)  # takes an uncached block: 3 free, 2 of them the cached chain
    b = make_req([1, 2, 3, 4, 5, 6, 7, 8, 0])  # 9 tokens: 5 blocks > 4 in total
    hits = bm.get_computed_blocks(b)
    assert len(hits) == 2
    before = (list(bm.ref_counts), list(bm.block_hashes), bm.num_free_blocks)
    # 2 new blocks fit the 3 free ones, but reviving the 2 hits needs 2 more: 4 > 3.
    assert not bm.allocate_slots(b, 8, hits)
    assert (list(bm.ref_counts), list(bm.block_hashes), bm.num_free_blocks) == before
    assert b.block_ids == []
    assert bm.allocate_slots(b, 6, hits)  # 2 revived + 1 new = 3
    assert b.block_ids[:2] == hits
    bm.check_invariants([hog, b])
    # Now nothing is free, yet a table that already covers the tokens needs nothing and succeeds.
    assert bm.num_free_blocks == 0
    assert not bm.allocate_slots(make_req([3, 3]), 2)
    assert bm.allocate_slots(b, 5)


# ---- stateful property test ------------------------------------------------------------------------

ALPHABET = st.integers(0, 2)  # few symbols, so prefixes collide often


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, steps, growth, preemptions, finishes and cache resets, checked against a model
    of what every KV slot holds and of the order in which freed cached blocks must be evicted.

    Rules never use preconditions: a rule with nothing to act on is a no-op (preconditions make
    hypothesis reject draws and explore far less). Prompts start with a prefix of one of a few shared
    base sequences, so whole blocks are shared and prefix hits are common."""

    @initialize(
        num_blocks=st.integers(2, 12),
        block_size=st.sampled_from([1, 2, 3, 4]),
        prefix=st.sampled_from([True, True, True, False]),
        bases=st.lists(st.lists(ALPHABET, min_size=16, max_size=16), min_size=1, max_size=3),
    )
    def setup(self, num_blocks: int, block_size: int, prefix: bool, bases: list[list[int]]) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix)
        self.bases = bases
        self.live: dict[str, Request] = {}
        self.pending: dict[str, int] = {}  # tokens allocated for this step but not yet computed
        self.preempted: list[Request] = []  # block-less requests (preempted, or admission failed)
        self.slots: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose K/V it holds
        # Free blocks that still have a hash, in the order they must be evicted: least recently freed
        # first and, within one request, its tail before its head (the head is what prompts share).
        self.evict_order: list[int] = []

    # ---- helpers --------------------------------------------------------------------------------
    @staticmethod
    def _pick(reqs: list[Request], i: int) -> Request | None:
        return reqs[i % len(reqs)] if reqs else None

    def _slot(self, req: Request, pos: int) -> int:
        bs = self.bm.block_size
        return req.block_ids[pos // bs] * bs + pos % bs

    def _uncached_free(self) -> int:
        bm = self.bm
        return sum(1 for b in range(bm.num_blocks) if bm.ref_counts[b] == 0 and bm.block_hashes[b] is None)

    def _snapshot(self) -> tuple:
        bm = self.bm
        return (list(bm.ref_counts), list(bm.block_hashes), bm.num_free_blocks)

    def _check_handed_out(self, new: list[int], hashes_before: list[int | None], uncached_free: int) -> None:
        """New blocks come from the uncached free ones first, then evict cached ones in order."""
        evicted = [b for b in new if hashes_before[b] is not None]
        assert len(evicted) == max(0, len(new) - uncached_free), "evicted while uncached blocks were free"
        assert evicted == self.evict_order[: len(evicted)], "cached blocks evicted out of order"
        del self.evict_order[: len(evicted)]

    def _free(self, req: Request) -> None:
        bm = self.bm
        table = list(req.block_ids)
        del self.live[req.req_id], self.pending[req.req_id]
        bm.free(req)
        assert req.block_ids == []
        for b in reversed(table):
            if bm.ref_counts[b] == 0 and bm.block_hashes[b] is not None:
                self.evict_order.append(b)

    def _admit(self, req: Request, frac: int, run: bool, sampled: int) -> None:
        bm, bs = self.bm, self.bm.block_size
        tokens = req.all_token_ids()
        hits = bm.get_computed_blocks(req)
        if not bm.enable_prefix_caching:
            assert hits == []
        assert len(set(hits)) == len(hits)
        assert len(hits) * bs <= req.num_tokens - 1, "a hit must leave at least one token to compute"
        for j, b in enumerate(hits):  # a hit's K/V must be exactly this prefix's
            for o in range(bs):
                expected = tuple(tokens[: j * bs + o + 1])
                assert self.slots.get(b * bs + o) == expected, "prefix hit on foreign K/V"
        num_cached = len(hits) * bs
        n = 1 + frac * (req.num_tokens - num_cached - 1) // 100
        num_free, uncached_free = bm.num_free_blocks, self._uncached_free()
        need = bm.num_blocks_for(num_cached + n) - len(hits) + sum(bm.ref_counts[b] == 0 for b in hits)
        hashes_before, refs_before, before = list(bm.block_hashes), list(bm.ref_counts), self._snapshot()
        ok = bm.allocate_slots(req, num_cached + n, hits)
        assert ok == (need <= num_free), "allocate_slots must succeed exactly when the blocks exist"
        if not ok:
            assert self._snapshot() == before and req.block_ids == [], "a failed allocation changed state"
            self.preempted.append(req)  # stays waiting
            return
        # Track it before checking anything else, so teardown frees it even when a check fails.
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.live[req.req_id] = req
        self.pending[req.req_id] = n
        assert req.block_ids[: len(hits)] == hits
        assert len(req.block_ids) == max(len(hits), bm.num_blocks_for(num_cached + n))
        assert all(bm.ref_counts[b] == refs_before[b] + 1 for b in hits)
        new = req.block_ids[len(hits) :]
        assert all(refs_before[b] == 0 and bm.ref_counts[b] == 1 for b in new)
        assert all(bm.block_hashes[b] is None for b in new), "a handed-out block kept its old hash"
        self.evict_order = [b for b in self.evict_order if b not in hits]  # revived: no longer free
        self._check_handed_out(new, hashes_before, uncached_free)
        if run:
            self._run(req, sampled)

    def _run(self, req: Request, sampled: int) -> None:
        """The forward computes the allocated tokens; a request that caught up samples one more."""
        bm = self.bm
        n = self.pending[req.req_id]
        tokens = req.all_token_ids()
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            block = req.block_ids[pos // bm.block_size]
            assert bm.ref_counts[block] == 1, "writing into a block another request holds"
            assert bm.block_hashes[block] is None, "writing into a block the prefix cache vouches for"
            self.slots[self._slot(req, pos)] = tuple(tokens[: pos + 1])
        req.num_computed_tokens += n
        self.pending[req.req_id] = 0
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(sampled)
        bm.cache_full_blocks(req)

    # ---- rules ----------------------------------------------------------------------------------
    @rule(
        base=st.integers(0, 2),
        shared=st.integers(0, 16),
        tail=st.lists(ALPHABET, max_size=4),
        frac=st.integers(0, 100),
        run=st.booleans(),
        sampled=ALPHABET,
    )
    def new_request(
        self, base: int, shared: int, tail: list[int], frac: int, run: bool, sampled: int
    ) -> None:
        tokens = self.bases[base % len(self.bases)][:shared] + tail
        self._admit(make_req(tokens or [0]), frac, run, sampled)

    @rule(i=st.integers(0, 100), frac=st.integers(0, 100), run=st.booleans(), sampled=ALPHABET)
    def readmit(self, i: int, frac: int, run: bool, sampled: int) -> None:
        req = self._pick(self.preempted, i)
        if req is not None:
            self.preempted.remove(req)
            self._admit(req, frac, run, sampled)

    @rule(i=st.integers(0, 100), sampled=ALPHABET)
    def run_step(self, i: int, sampled: int) -> None:
        req = self._pick([self.live[r] for r, n in self.pending.items() if n], i)
        if req is not None:
            self._run(req, sampled)

    @rule(i=st.integers(0, 100), k=st.integers(0, 8), run=st.booleans(), sampled=ALPHABET)
    def grow(self, i: int, k: int, run: bool, sampled: int) -> None:
        """Allocate for the next k tokens (k = 0: a table that already covers them, a no-op)."""
        bm = self.bm
        req = self._pick([self.live[r] for r, n in self.pending.items() if n == 0], i)
        if req is None:
            return
        n = min(k, req.num_tokens - req.num_computed_tokens)
        target = req.num_computed_tokens + n
        need = max(0, bm.num_blocks_for(target) - len(req.block_ids))
        num_free, uncached_free = bm.num_free_blocks, self._uncached_free()
        before, table, hashes_before = self._snapshot(), list(req.block_ids), list(bm.block_hashes)
        ok = bm.allocate_slots(req, target)
        assert ok == (need <= num_free), "allocate_slots must succeed exactly when the blocks exist"
        if not ok:
            assert self._snapshot() == before and req.block_ids == table, "a failed allocation changed state"
            return
        self.pending[req.req_id] = n
        assert req.block_ids[: len(table)] == table
        assert len(req.block_ids) == len(table) + need
        if need == 0:
            assert self._snapshot() == before
        self._check_handed_out(req.block_ids[len(table) :], hashes_before, uncached_free)
        if run and n:
            self._run(req, sampled)

    @rule(i=st.integers(0, 100))
    def preempt(self, i: int) -> None:
        req = self._pick(list(self.live.values()), i)
        if req is not None:
            self._free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.preempted.append(req)

    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        req = self._pick(list(self.live.values()), i)
        if req is not None:
            self._free(req)

    @rule(go=st.integers(0, 7))
    def reset_prefix_cache(self, go: int) -> None:
        if go:  # rare: a reset wipes the state the other rules build up
            return
        self.bm.reset_prefix_cache()
        assert all(h is None for h in self.bm.block_hashes)
        self.evict_order.clear()

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def blocks_are_accounted_for(self) -> None:
        bm = self.bm
        live = list(self.live.values())
        bm.check_invariants(live)
        referenced = {b for r in live for b in r.block_ids}
        assert bm.num_free_blocks + len(referenced) == bm.num_blocks
        assert bm.num_free_blocks == sum(1 for c in bm.ref_counts if c == 0)
        assert bm.usage == pytest.approx(len(referenced) / bm.num_blocks)
        for r in live:
            assert len(set(r.block_ids)) == len(r.block_ids)
            assert len(r.block_ids) * bm.block_size >= r.num_computed_tokens + self.pending[r.req_id]
        assert all(not r.block_ids for r in self.preempted)

    @invariant()
    def computed_kv_is_intact(self) -> None:
        """Nobody overwrote a block a live request has computed K/V in."""
        for r in self.live.values():
            tokens = r.all_token_ids()
            for pos in range(r.num_computed_tokens):
                assert self.slots.get(self._slot(r, pos)) == tuple(tokens[: pos + 1])

    def teardown(self) -> None:
        bm = getattr(self, "bm", None)
        if bm is None:
            return
        for r in list(self.live.values()):
            bm.free(r)
        bm.check_invariants([])
        assert bm.num_free_blocks == bm.num_blocks
        assert all(c == 0 for c in bm.ref_counts)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


def test_uncached_blocks_are_handed_out_lowest_id_first():
    """Block tables stay compact however requests finish (scattered tables slowed decode attention)."""
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    a, b, c = make_req(list(range(16))), make_req(list(range(16))), make_req(list(range(16)))
    for r in (a, b, c):
        assert bm.allocate_slots(r, 16)
    assert (a.block_ids, b.block_ids, c.block_ids) == ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
    bm.free(c)
    bm.free(a)  # freed last, but 0-3 come before 8-11
    d = make_req(list(range(24)))
    assert bm.allocate_slots(d, 24)
    assert d.block_ids == [0, 1, 2, 3, 8, 9]
    bm.check_invariants([b, d])


def test_uncached_blocks_go_before_cached_ones_and_reset_uncaches():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_req(list(range(9)))
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)  # blocks 0 and 1 get hashes; block 2 (partial) does not
    bm.free(a)
    b = make_req([7] * 12)
    assert bm.allocate_slots(b, 12)
    assert b.block_ids == [2, 3, 4]  # the uncached ones; the cached prefix survives
    assert len(bm.get_computed_blocks(make_req(list(range(9))))) == 2
    bm.reset_prefix_cache()
    bm.check_invariants([b])
    c = make_req([9] * 8)
    assert bm.allocate_slots(c, 8) and c.block_ids == [0, 1]


def test_prefix_hashes_are_digests_that_python_hash_collisions_do_not_fool() -> None:
    # CPython's hash(-1) == hash(-2): with hash() a block of [-2, ...] found the KV of [-1, ...].
    assert hash((None, (-1,))) == hash((None, (-2,)))
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req([-1, 5, 6, 7, 0])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.get_computed_blocks(make_req([-2, 5, 6, 7, 0])) == []
    assert bm.get_computed_blocks(make_req([-1, 5, 6, 7, 0])) == a.block_ids[:1]
    h = hash_block(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert hash_block(None, [1, 2, 3, 4], extra=b"adapter") != h


def test_a_hash_hit_with_other_tokens_is_a_miss(monkeypatch) -> None:
    import pdserve.kv.block_manager as block_manager

    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens, extra=b"": b"same" * 8)
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_req([1, 2, 3, 4, 0])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.get_computed_blocks(make_req([9, 9, 9, 9, 0])) == []  # same "hash", other tokens
    assert bm.get_computed_blocks(make_req([1, 2, 3, 4, 0])) == a.block_ids[:1]
