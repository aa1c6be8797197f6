"""BlockManager.truncate: the slots of rejected draft tokens go back to the free list; blocks shared with
other requests or full of verified tokens stay as they were. Pure Python."""

from __future__ import annotations

from pdserve.kv.block_manager import BlockManager
from pdserve.request import Request, SamplingParams


def make_req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=100))


def test_truncate_frees_trailing_blocks_only() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_req("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(req, 11)  # 5 tokens + 6 draft slots: 3 blocks
    first, second, third = req.block_ids
    bm.truncate(req, 5)
    assert req.block_ids == [first, second]
    assert bm.ref_counts[third] == 0 and bm.num_free_blocks == 6
    bm.check_invariants([req])
    bm.truncate(req, 8)  # already within two blocks: nothing to do
    bm.truncate(req, 100)
    assert req.block_ids == [first, second]
    assert bm.allocate_slots(req, 9) and req.block_ids == [first, second, third]  # lowest id first again
    bm.check_invariants([req])
    bm.truncate(req, 0)
    assert req.block_ids == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_truncate_keeps_shared_blocks_for_their_other_holders() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full and hashed
    b = make_req("b", [1, 2, 3, 4, 9])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2] and bm.allocate_slots(b, 7, hits)  # + 2 draft slots
    b.num_computed_tokens = 4
    bm.truncate(b, 2)
    assert b.block_ids == a.block_ids[:1]
    assert bm.ref_counts[a.block_ids[1]] == 1  # still a's
    assert bm._req_hashes["b"] == bm._req_hashes["a"][:1]  # b forgets the hashes of what it dropped
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8
    # The hashed blocks stay findable: a third request still hits them.
    c = make_req("c", [1, 2, 3, 4, 7])
    assert len(bm.get_computed_blocks(c)) == 2
