"""KVCacheManager / BlockPool: allocation, ref counts, prefix hits, LRU eviction, no leaks."""
from __future__ import annotations

import random

import pytest

from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def _prefill(kv: KVCacheManager, req: Request) -> int:
    """Admit a request like the scheduler does and compute its whole prompt."""
    hit = kv.get_computed_blocks(req)
    req.num_computed_tokens = hit
    assert kv.allocate(req, req.num_tokens - hit)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return hit


def test_allocate_grows_table_and_free_is_idempotent():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    r = _req("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert kv.allocate(r, 9)
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 5
    r.num_computed_tokens = 9
    assert kv.allocate(r, 3)  # 12 tokens still fit 3 blocks
    assert len(kv.block_ids("a")) == 3
    assert kv.allocate(r, 4)  # 13 -> 4 blocks
    assert len(kv.block_ids("a")) == 4
    assert kv.usage == pytest.approx(0.5)
    kv.free("a")
    kv.free("a")
    assert kv.num_free_blocks == 8 and kv.block_ids("a") == []
    kv.pool.check()


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(3, BS, enable_prefix_caching=True)
    r = _req("a", list(range(20)))
    assert not kv.allocate(r, 20)  # needs 5 of 3
    assert kv.num_free_blocks == 3 and kv.block_ids("a") == []
    assert kv.reserve("b", 13) is None
    ids = kv.reserve("b", 12)
    assert ids is not None and sorted(ids) == [0, 1, 2]
    with pytest.raises(ValueError):
        kv.reserve("b", 1)
    kv.free("b")
    assert kv.num_free_blocks == 3


def test_prefix_hits_full_blocks_only():
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    shared = list(range(100, 110))  # 2.5 blocks
    a = _req("a", shared + [1, 2, 3])
    assert _prefill(kv, a) == 0
    b = _req("b", shared + [7, 8, 9, 10])
    assert _prefill(kv, b) == 2 * BS
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    # different first block -> nothing hits, even though later blocks are identical
    c = _req("c", [999] + shared[1:] + [1, 2, 3])
    assert _prefill(kv, c) == 0
    st = kv.stats()
    assert st["prefix_hits"] == 8
    assert st["prefix_queries"] == a.num_tokens + b.num_tokens + c.num_tokens
    # shared blocks are ref-counted: freeing a keeps b's blocks held
    kv.free("a")
    for bid in kv.block_ids("b"):
        assert kv.pool.blocks[bid].ref_cnt >= 1
    kv.pool.check()


def test_last_token_never_counted_as_cached():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    toks = list(range(2 * BS))  # exactly 2 full blocks
    _prefill(kv, _req("a", toks))
    kv.free("a")
    b = _req("b", toks)
    # the whole prompt is cached, but the last token must be recomputed -> only 1 block hits
    assert kv.get_computed_blocks(b) == BS
    c = _req("c", toks + [5])
    assert kv.get_computed_blocks(c) == 2 * BS


def test_no_hits_when_disabled():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    toks = list(range(12))
    _prefill(kv, _req("a", toks))
    assert _prefill(kv, _req("b", toks)) == 0
    assert kv.stats()["prefix_hits"] == 0


def test_failed_admission_counts_stats_once():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    toks = list(range(9))
    _prefill(kv, _req("a", toks))
    kv.free("a")
    hog = _req("hog", [50] * 4)
    assert kv.allocate(hog, 4 * BS - 0) is True  # takes all 4 blocks (evicting the cache)
    b = _req("b", toks)
    assert kv.get_computed_blocks(b) == 0
    assert not kv.allocate(b, 9)
    kv.free("b")
    kv.free("hog")
    assert kv.num_free_blocks == 4
    assert kv.stats()["prefix_queries"] == 9  # only a's query was committed


def test_eviction_is_lru_and_drops_hash():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    p1, p2 = [1] * BS + [9], [2] * BS + [9]
    _prefill(kv, _req("a", p1))
    _prefill(kv, _req("b", p2))
    kv.free("a")  # a's full block freed first -> least recently used
    kv.free("b")
    assert kv.stats()["num_cached_blocks"] == 2
    # touching p1 again (a hit) makes p2 the LRU one
    c = _req("c", p1)
    assert kv.get_computed_blocks(c) == BS
    kv.allocate(c, 1)
    kv.free("c")
    # need all 4 blocks: the 2 uncached tails go first, then cached ones in LRU order (p2 first)
    hog = _req("hog", [7] * (3 * BS))
    assert kv.allocate(hog, 3 * BS)
    assert kv.get_computed_blocks(_req("x", p1)) == BS  # p1 still cached
    kv.free("x")
    assert kv.get_computed_blocks(_req("y", p2)) == 0  # p2 evicted
    kv.free("y")
    assert kv.stats()["num_evictions"] == 1
    kv.pool.check()


def test_reallocated_block_is_not_hit_with_stale_content():
    kv = KVCacheManager(2, BS, enable_prefix_caching=True)
    p = [3] * BS + [1]
    _prefill(kv, _req("a", p))
    kv.free("a")
    hog = _req("hog", [4] * (2 * BS))
    assert kv.allocate(hog, 2 * BS)  # reuses both blocks, evicting p's block
    kv.free("hog")
    assert kv.get_computed_blocks(_req("b", p)) == 0


def test_random_mix_never_leaks():
    rng = random.Random(1234)
    kv = KVCacheManager(40, BS, enable_prefix_caching=True)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 15))] for _ in range(5)]
    live: dict[str, Request] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.35 or not live:
            rid = f"r{step}"
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            r = _req(rid, toks)
            hit = kv.get_computed_blocks(r)
            assert hit % BS == 0 and hit < r.num_tokens
            r.num_computed_tokens = hit
            n = rng.randrange(1, r.num_tokens - hit + 1)  # maybe a chunk
            if kv.allocate(r, n):
                r.num_computed_tokens += n
                kv.cache_full_blocks(r)
                live[rid] = r
            else:
                kv.free(rid)
        elif op < 0.75:  # decode / continue prefill
            r = live[rng.choice(list(live))]
            if r.num_computed_tokens >= r.num_tokens:
                r.output_token_ids.append(rng.randrange(50))
            n = r.num_tokens - r.num_computed_tokens
            if kv.allocate(r, n):
                r.num_computed_tokens += n
                kv.cache_full_blocks(r)
                assert len(kv.block_ids(r.request_id)) == kv.blocks_for(r.num_computed_tokens)
            else:  # "preempt": drop everything, recompute later
                kv.free(r.request_id)
                del live[r.request_id]
        elif op < 0.95:  # finish
            rid = rng.choice(list(live))
            kv.free(rid)
            del live[rid]
        else:  # reserve / release (decode side)
            ids = kv.reserve(f"res{step}", rng.randrange(1, 20))
            kv.free(f"res{step}")
            if ids is not None:
                assert len(set(ids)) == len(ids)
        if step % 50 == 0:
            kv.pool.check()
            held = [b for r in live.values() for b in kv.block_ids(r.request_id)]
            for bid in set(held):
                assert kv.pool.blocks[bid].ref_cnt == held.count(bid)
    for rid in list(live):
        kv.free(rid)
    kv.pool.check()
    assert kv.num_free_blocks == 40 and kv.usage == 0.0
    assert kv.stats()["prefix_hits"] > 0


def test_blocks_needed_total_is_the_sum_of_each_rows_positive_need():
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    rng = random.Random(3)
    reqs = []
    for i in range(12):
        r = _req(f"r{i}", list(range(rng.randrange(1, 30))))
        if i % 3:  # some hold blocks already, computed up to a block edge or inside one
            assert kv.allocate(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens - rng.randrange(0, 3)
        reqs.append(r)
    for n in (0, 1, 3, BS + 1):
        items = [(r, n + i % 2) for i, r in enumerate(reqs)]
        want = sum(max(0, kv.blocks_needed(r, k)) for r, k in items)
        assert kv.blocks_needed_total(iter(items)) == want
    assert kv.blocks_needed_total([]) == 0
