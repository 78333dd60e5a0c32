"""BlockPool: the physical KV blocks, their ref counts, free lists and the prefix-cache map.

Invariants (checked by tests/engine/test_kv_cache.py):
- every block id 0..num_blocks-1 is in exactly one place: held (ref_cnt > 0), the uncached free
  list, or the cached free LRU (ref_cnt == 0, key set, still findable through `cached`).
- `cached[key] == block_id` implies `blocks[block_id].key == key`.
- Allocation takes uncached free blocks first, then evicts the least recently freed cached
  block (dropping its map entry), so warm prefixes survive as long as possible.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

# A block's prefix-cache key: (parent chain hash or None for the first block, tokens of the block).
# The dict compares whole keys, so a hit needs the exact tokens of this block AND the parent's
# chain hash; chain hash = hash(key). NOTE: a 64-bit collision of two different parent chains
# that also share this block's exact tokens would be needed for a false hit.
BlockKey = tuple


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None  # set while the block is registered in the prefix cache
    chain_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self.cached: dict[BlockKey, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def take(self, n: int) -> list[int] | None:
        """Take n fresh blocks (ref_cnt 1, no cache key), or None (nothing taken) if short."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free_uncached:
                bid = self._free_uncached.popleft()
            else:
                bid, _ = self._free_cached.popitem(last=False)
                self._evict(bid)
            b = self.blocks[bid]
            assert b.ref_cnt == 0, f"block {bid} on a free list with ref_cnt {b.ref_cnt}"
            b.ref_cnt = 1
            out.append(bid)
        return out

    def _evict(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.key is not None:
            if self.cached.get(b.key) == bid:
                del self.cached[b.key]
            b.key = None
            b.chain_hash = None
            self.num_evictions += 1

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key)

    def touch(self, bid: int) -> None:
        """ref++ on a block found in the cache (pulls it off the free LRU if it was free)."""
        b = self.blocks[bid]
        if b.ref_cnt == 0:
            del self._free_cached[bid]
        b.ref_cnt += 1

    def register(self, bid: int, key: BlockKey) -> int:
        """Make a held full block findable under key; returns its chain hash. If another block
        already holds this key (two requests computed the same prefix at once) this one stays
        unregistered and is recycled as a plain block when freed."""
        b = self.blocks[bid]
        h = hash(key)
        if b.key is None and key not in self.cached:
            b.key = key
            b.chain_hash = h
            self.cached[key] = bid
        return h

    def release(self, bids: list[int]) -> None:
        """ref-- on each block; blocks reaching 0 go to a free list. Pass tail blocks first so
        a request's tail is evicted before its (more shareable) head."""
        for bid in bids:
            b = self.blocks[bid]
            assert b.ref_cnt > 0, f"double free of block {bid}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.key is not None:
                    self._free_cached[bid] = None  # most recently used end
                else:
                    self._free_uncached.append(bid)

    def check(self) -> None:
        """Assert the pool invariants (tests and debugging)."""
        free_u = set(self._free_uncached)
        free_c = set(self._free_cached)
        assert len(free_u) == len(self._free_uncached) and not (free_u & free_c)
        for b in self.blocks:
            if b.ref_cnt == 0:
                assert (b.block_id in free_c) == (b.key is not None), b
                assert (b.block_id in free_u) == (b.key is None), b
            else:
                assert b.block_id not in free_u and b.block_id not in free_c, b
        for key, bid in self.cached.items():
            assert self.blocks[bid].key == key
