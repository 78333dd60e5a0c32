"""KVCacheManager: per-request block tables over a BlockPool, with prefix caching.

A request's block table covers its tokens in order: token position p lives in
block_ids(rid)[p // block_size] at offset p % block_size.

Prefix caching hashes FULL blocks along a chain: key_i = (chain_hash_{i-1}, tokens of block i),
chain_hash_i = hash(key_i), so a block is reused only when its whole prefix matches.
- `get_computed_blocks(req)` (first scheduling, request holds no blocks) attaches the longest
  run of cached leading blocks (ref++). The last known token is never counted as cached: it
  must be recomputed to produce logits, so at most (num_tokens - 1) // block_size full blocks hit.
- `cache_full_blocks(req)` (after each step) registers the blocks that
  req.num_computed_tokens has filled since the last call.
- Freed blocks keep their key on an LRU free list until reallocated (then evicted from the map).
- `reserve(rid, n, prompt)` (decode side) pins the prompt's cached leading full blocks the same
  way and takes fresh blocks for the rest; a KV transfer writes only the fresh ones
  (`transfer_block_ids`). Nothing is registered before the KV is in place (`add_prefilled`
  calls `cache_full_blocks`), so a failed transfer publishes no block.

Stats: prefix_queries / prefix_hits count tokens, committed when the allocation that follows
`get_computed_blocks` succeeds (a failed admission that is retried later is counted once).
"""
from __future__ import annotations

from engine.block_pool import BlockPool
from engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        # chain hashes of the leading full blocks already registered / hit, per request
        self._hashes: dict[str, list[int]] = {}
        # reservations: leading blocks of the table that were prefix-cache hits (no transfer)
        self._skip: dict[str, int] = {}
        self._pending_stats: dict[str, tuple[int, int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Overlapped decode (engine/engine.py): while launched steps may still run on the
        # device, `fence` is the sequence number of the last one and freed blocks wait in
        # `_deferred` until that step is known complete (release_deferred): a still-running
        # step may write the KV of a request that has just finished into them, and a block
        # must not be handed to a new owner (a KV import from another process) before that.
        self.fence = 0  # 0: nothing in flight, frees return blocks at once
        self._deferred: list[tuple[int, list[int]]] = []

    # ---- sizes ----------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] when it holds none)."""
        return list(self._tables.get(request_id, ()))

    def has_blocks(self, request_id: str) -> bool:
        return bool(self._tables.get(request_id))

    # ---- prefix cache ---------------------------------------------------------------
    def _key(self, parent: int | None, tokens: list[int], i: int) -> tuple:
        bs = self.block_size
        return (parent, tuple(tokens[i * bs:(i + 1) * bs]))

    def _match(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Pin (ref++) the cached leading full blocks of `tokens`, the last token excluded
        (it must be computed or sent to produce logits). -> (block ids, their chain hashes)."""
        table: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return table, hashes
        parent = None
        for i in range((len(tokens) - 1) // self.block_size):
            key = self._key(parent, tokens, i)
            bid = self.pool.lookup(key)
            if bid is None:
                break
            self.pool.touch(bid)
            table.append(bid)
            parent = hash(key)
            hashes.append(parent)
        return table, hashes

    def get_computed_blocks(self, req: Request) -> int:
        """Attach cached leading full blocks to a request that holds none; return #tokens hit."""
        rid = req.request_id
        if self._tables.get(rid):
            raise RuntimeError(f"get_computed_blocks: request {rid!r} already holds blocks")
        tokens = req.all_token_ids
        table, hashes = self._match(tokens)
        if table:
            self._tables[rid] = table
            self._hashes[rid] = hashes
        hit = len(table) * self.block_size
        self._pending_stats[rid] = (len(tokens), hit)
        return hit

    def cache_full_blocks(self, req: Request, num_computed: int | None = None) -> None:
        """Register the request's blocks that are now full of computed tokens.
        num_computed: count the request's tokens as computed up to there (default: its
        num_computed_tokens): a step launched on the device computes them before anything
        launched after it runs, so blocks it completes may be hit by a later step already
        (engine/overlap.py); tokens not yet known on the host are never hashed."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        table = self._tables.get(rid)
        if not table:
            return
        hashes = self._hashes.setdefault(rid, [])
        done = req.num_computed_tokens if num_computed is None else num_computed
        n_full = min(done, req.num_tokens) // self.block_size
        n_full = min(n_full, len(table))
        if n_full <= len(hashes):
            return  # the common decode step: no block completed (skip building all_token_ids)
        tokens = req.all_token_ids
        for i in range(len(hashes), n_full):
            key = self._key(hashes[-1] if hashes else None, tokens, i)
            hashes.append(self.pool.register(table[i], key))

    def pending_hashes(self, req: Request, num_new_tokens: int) -> list[int]:
        """Chain hashes of the full blocks that computing num_new_tokens more tokens will
        complete (not cached yet). The scheduler uses them to defer a waiting request that
        would otherwise recompute a prefix another request computes in the same step."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes.get(req.request_id, [])
        parent = hashes[-1] if hashes else None
        end = min(req.num_computed_tokens + num_new_tokens, req.num_tokens) // self.block_size
        if end <= len(hashes):
            return []
        tokens = req.all_token_ids
        out = []
        for i in range(len(hashes), end):
            parent = hash(self._key(parent, tokens, i))
            out.append(parent)
        return out

    def next_block_hash(self, req: Request, num_hit_tokens: int) -> int | None:
        """Chain hash of the first full block after a request's prefix hit, if it could hit."""
        if not self.enable_prefix_caching:
            return None
        tokens = req.all_token_ids
        i = num_hit_tokens // self.block_size
        if i >= (len(tokens) - 1) // self.block_size:
            return None
        hashes = self._hashes.get(req.request_id, [])
        parent = hashes[i - 1] if i > 0 else None
        return hash(self._key(parent, tokens, i))

    # ---- allocation -----------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """New blocks allocate(req, num_new_tokens) would take (<= 0: none)."""
        held = len(self._tables.get(req.request_id, ()))
        return self.blocks_for(req.num_computed_tokens + num_new_tokens) - held

    def blocks_needed_total(self, items) -> int:
        """Sum over (request, new tokens) pairs of the blocks allocate would take for each
        (blocks_needed's positive parts), in one pass (engine/overlap.py: every running row)."""
        bs, tables, need = self.block_size, self._tables, 0
        for req, n in items:
            k = -(-(req.num_computed_tokens + n) // bs) - len(tables.get(req.request_id, ()))
            if k > 0:
                need += k
        return need

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow the block table to cover req.num_computed_tokens + num_new_tokens tokens.
        All-or-nothing: on False nothing changed."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = req.request_id
        table = self._tables.get(rid, [])
        need = self.blocks_needed(req, num_new_tokens)
        if need > 0:
            new = self.pool.take(need)
            if new is None:
                return False
            table = table + new
            self._tables[rid] = table
        pending = self._pending_stats.pop(rid, None)
        if pending is not None:
            self.prefix_queries += pending[0]
            self.prefix_hits += pending[1]
        return True

    def reserve(self, request_id: str, num_tokens: int,
                prompt_token_ids: list[int] | None = None) -> list[int] | None:
        """Decode side: blocks for an incoming KV of num_tokens tokens, or None (nothing held).
        With the prompt, its cached leading full blocks are pinned and head the table; the
        return value is only the fresh blocks a transfer must fill (`transfer_block_ids`)."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if prompt_token_ids is not None and len(prompt_token_ids) != num_tokens:
            raise ValueError(f"{len(prompt_token_ids)} prompt tokens given for a reservation "
                             f"of {num_tokens}")
        if self._tables.get(request_id):
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        hit, hashes = self._match(list(prompt_token_ids)) if prompt_token_ids else ([], [])
        new = self.pool.take(self.blocks_for(num_tokens) - len(hit))
        if new is None:
            self.pool.release(hit[::-1])  # unpin: they go back to the cached LRU
            return None
        self._tables[request_id] = hit + new
        if hit:
            self._hashes[request_id] = hashes
            self._skip[request_id] = len(hit)
        return list(new)

    def num_skipped_blocks(self, request_id: str) -> int:
        """Leading blocks of a reservation that its transfer does not write (cache hits)."""
        return self._skip.get(request_id, 0)

    def transfer_block_ids(self, request_id: str) -> list[int]:
        """The blocks a reservation's KV transfer writes, in order (a copy)."""
        return list(self._tables.get(request_id, ()))[self._skip.get(request_id, 0):]

    def free(self, request_id: str) -> None:
        """Drop the request's blocks (ref--); idempotent."""
        self._pending_stats.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._skip.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            if self.fence:
                self._deferred.append((self.fence, table[::-1]))
            else:
                self.pool.release(table[::-1])  # tail first: evicted before the shared head

    def release_deferred(self, done: int | None = None) -> None:
        """Return the blocks freed while steps up to sequence number `done` were in flight
        (None: every deferred block; nothing runs any more)."""
        keep = []
        for fence, blocks in self._deferred:
            if done is None or fence <= done:
                self.pool.release(blocks)
            else:
                keep.append((fence, blocks))
        self._deferred = keep

    @property
    def num_deferred_blocks(self) -> int:
        return sum(len(b) for _, b in self._deferred)

    # ---- introspection --------------------------------------------------------------
    def stats(self) -> dict:
        q = self.prefix_queries
        return {
            "prefix_queries": q,
            "prefix_hits": self.prefix_hits,
            "prefix_hit_rate": (self.prefix_hits / q) if q else 0.0,
            "num_cached_blocks": len(self.pool.cached),
            "num_evictions": self.pool.num_evictions,
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "usage": self.usage,
        }
