"""Paged KV-cache bookkeeping: which physical blocks each request owns. Pure Python, no torch.

Blocks hold `block_size` tokens. A block is free when no request references it. A *full* block whose
tokens have been computed gets a hash chained over its whole prefix (parent hash, its token ids), so a
later request with the same prefix reuses it instead of recomputing (prefix caching). The hash is a
BLAKE2b digest, not Python's `hash()`: a client who could craft a collision would be served another
user's KV (vLLM moved to sha256 for this reason); and a hit is trusted only once the block's own tokens
compare equal too. Freed blocks keep
their hash and stay findable until they are handed out again. Free blocks without a hash are handed out
first, lowest block id first: that keeps a request's blocks close together in memory, which the decode
attention reads faster (measured: with the most recently freed block reused first instead, decode steps
slowed 5-10% per pass over ShareGPT as block tables scattered over the cache). Among cached free blocks
the least recently freed goes first, tail blocks of a sequence before its head (the head is what other
prompts share).

A request's block table is `Request.block_ids`; only this class appends to or clears it.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pdserve.request import Request

BlockHash = bytes


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """256-bit BLAKE2b digest of a full block given the digest of the block before it, its token ids and
    anything else its KV depends on (`extra`: none yet; adapters would go here). The same in every
    process, so instances can compare hashes."""
    h = hashlib.blake2b(digest_size=32)
    h.update(parent_hash or b"\0" * 32)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # of each hashed block
        # Blocks with no references: without a hash (a heap: lowest id next), and cached ones in the order
        # they are evicted (first = next).
        self._free_uncached: list[int] = list(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._req_hashes: dict[str, list[BlockHash]] = {}  # req_id -> hashes of its full, computed blocks
        self.num_prefix_hit_tokens = 0
        self.num_prefix_queried_tokens = 0
        # Told of every block that becomes free, and whether it stays cached (hashed): an int4 KV cache
        # (`KVCache.note_freed`) keeps state per block that must follow its life. None: nobody listens.
        self.on_free: Callable[[int, bool], None] | None = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    # ---- prefix cache --------------------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached full blocks that prefixes `req`'s tokens. At least one token is always
        left to compute (the step that computes it produces the logits to sample from). None for a
        request that scores its prompt (`prompt_logprobs`: every position's logits are wanted). Takes no
        references: pass the result to `allocate_slots`."""
        if not self.enable_prefix_caching or req.block_ids or req.params.prompt_logprobs is not None:
            return []
        num_full = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        parent: BlockHash | None = None
        tokens = req.all_token_ids()
        bs = self.block_size
        for i in range(num_full):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            h = hash_block(parent, block_tokens)
            block = self._cached.get(h)
            if block is None or self.block_tokens[block] != tuple(block_tokens):  # a collision is a miss
                break
            hits.append(block)
            parent = h
        self.num_prefix_queried_tokens += req.num_prompt_tokens
        self.num_prefix_hit_tokens += len(hits) * bs
        return hits

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of `req`'s blocks that became full and computed since the last call."""
        if not self.enable_prefix_caching:
            return
        hashes = self._req_hashes.setdefault(req.req_id, [])
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if num_full <= len(hashes):
            return
        bs = self.block_size
        tokens = req.all_token_ids()
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            block_tokens = tokens[i * bs : (i + 1) * bs]
            h = hash_block(parent, block_tokens)
            hashes.append(h)
            parent = h
            block = req.block_ids[i]
            if self.block_hashes[block] is None and h not in self._cached:
                self.block_hashes[block] = h
                self.block_tokens[block] = tuple(block_tokens)
                self._cached[h] = block

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Make `req`'s block table cover `num_tokens` tokens, first adopting `computed_blocks` (from
        `get_computed_blocks`, only when the table is empty). All or nothing: returns False and changes
        nothing when there are not enough free blocks."""
        assert not computed_blocks or not req.block_ids
        num_have = len(req.block_ids) + len(computed_blocks)
        num_new = max(0, self.num_blocks_for(num_tokens) - num_have)
        num_revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if num_new + num_revived > self.num_free_blocks:
            return False
        for b in computed_blocks:
            if self.ref_counts[b] == 0:
                del self._free_cached[b]  # a computed block has a hash
            self.ref_counts[b] += 1
            req.block_ids.append(b)
        if computed_blocks:
            self._req_hashes[req.req_id] = [self.block_hashes[b] for b in computed_blocks]  # type: ignore[misc]
        for _ in range(num_new):
            if self._free_uncached:
                b = heapq.heappop(self._free_uncached)
            else:
                b, _ = self._free_cached.popitem(last=False)
            h = self.block_hashes[b]
            if h is not None:  # evict: its contents are about to be overwritten
                self.block_hashes[b] = None
                self.block_tokens[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
            self.ref_counts[b] = 1
            req.block_ids.append(b)
        return True

    def free(self, req: Request) -> None:
        """Drop `req`'s references; blocks nobody else holds become free (cached ones stay findable)."""
        self._release(req.block_ids)
        req.block_ids.clear()
        self._req_hashes.pop(req.req_id, None)

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, last first; blocks nobody holds any more become free (to the
        lowest-id heap, or, when hashed, to the cached pool that stays findable)."""
        for b in reversed(block_ids):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is None:
                    heapq.heappush(self._free_uncached, b)
                else:
                    self._free_cached[b] = None
                if self.on_free is not None:
                    self.on_free(b, self.block_hashes[b] is not None)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Shrink `req`'s block table to the blocks `num_tokens` tokens need, freeing the rest: the slots
        of draft tokens a step rejected (speculative decoding). Nothing unverified was ever hashed
        (`cache_full_blocks` only sees computed, accepted tokens), so freed blocks go back uncached unless
        another request's verified tokens made them shared; hashes of dropped blocks are forgotten."""
        keep = self.num_blocks_for(num_tokens)
        if keep >= len(req.block_ids):
            return
        self._release(req.block_ids[keep:])
        del req.block_ids[keep:]
        hashes = self._req_hashes.get(req.req_id)
        if hashes is not None:
            del hashes[keep:]

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. for a fair benchmark run)."""
        for h, b in self._cached.items():
            self.block_hashes[b] = None
            self.block_tokens[b] = None
        self._cached.clear()
        for b in self._free_cached:  # free blocks without a hash now
            heapq.heappush(self._free_uncached, b)
        self._free_cached.clear()
        for hashes in self._req_hashes.values():
            hashes.clear()

    def check_invariants(self, live: Sequence[Request]) -> None:
        """Every block is either free or referenced exactly as often as live requests hold it."""
        counts = [0] * self.num_blocks
        for req in live:
            for b in req.block_ids:
                counts[b] += 1
        assert counts == self.ref_counts, "reference counts disagree with block tables"
        free = set(self._free_uncached) | set(self._free_cached)
        assert len(free) == self.num_free_blocks, "a block is free twice"
        assert all((c == 0) == (b in free) for b, c in enumerate(counts)), "free list out of sync"
        assert all(self.block_hashes[b] is None for b in self._free_uncached), "a cached block on the uncached heap"
        for h, b in self._cached.items():
            assert self.block_hashes[b] == h


class HostBlockPool:
    """Blocks of the host-memory tier that swapped-out requests park their KV in (`preemption_mode`
    "swap"). Only whole requests move, so this is a free list and nothing more: no sharing, no prefix
    cache. Lowest ids first, like the device cache, so a request's host blocks stay close together."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the host tier needs at least one block")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` free host blocks, or None (and nothing taken) when there are not that many."""
        if num_blocks > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(num_blocks)]

    def free(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            heapq.heappush(self._free, b)

    def check_invariants(self, held: Sequence[Sequence[int]]) -> None:
        """Every host block is either free or held by exactly one swapped request."""
        taken = [b for ids in held for b in ids]
        assert len(set(taken)) == len(taken), "a host block held twice"
        assert not set(taken) & set(self._free), "a held host block is on the free list"
        assert len(set(self._free)) == len(self._free), "a host block is free twice"
        assert len(taken) + len(self._free) == self.num_blocks, "host blocks leaked"
