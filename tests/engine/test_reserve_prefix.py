"""Decode's prefix-aware reservation (KVCacheManager.reserve with the prompt): cached leading
full blocks are pinned and not transferred, a failed reservation publishes nothing, eviction
keeps the LRU of free cached blocks; at the engine level a transfer of only the blocks after
the held ones decodes the same tokens as one engine doing everything."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import InvalidRequestError, SamplingParams
from tests.engine.disagg_util import decode_to_end, prefill_outputs

BS = 4


def _arrive(kv: KVCacheManager, rid: str, prompt: list[int]) -> list[int]:
    """Reserve, then what add_prefilled does once the KV is in: register the full blocks."""
    fresh = kv.reserve(rid, len(prompt), prompt)
    req = Request(rid, list(prompt), SamplingParams())
    req.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(req)
    return fresh


def test_second_reservation_pins_the_held_prefix():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = list(range(100, 114))  # 14 tokens: 3 full blocks + 2 tokens
    assert len(_arrive(kv, "a", a)) == 4 and kv.num_skipped_blocks("a") == 0
    b = a[:12] + [7, 8, 9]  # same 3 full blocks, another tail
    fresh = kv.reserve("b", len(b), b)
    assert kv.num_skipped_blocks("b") == 3 and len(fresh) == 1
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]  # shared, not copied
    assert kv.transfer_block_ids("b") == fresh
    assert all(kv.pool.blocks[x].ref_cnt == 2 for x in kv.block_ids("b")[:3])
    kv.free("a")  # the pinned blocks stay held by b: not evictable
    assert all(kv.pool.blocks[x].ref_cnt == 1 for x in kv.block_ids("b")[:3])
    assert kv.pool.take(kv.num_free_blocks) is not None  # takes every free block ...
    assert all(kv.pool.blocks[x].key is not None for x in kv.block_ids("b")[:3])  # ... not b's
    kv.pool.check()


def test_last_token_block_always_sent_and_divergence_stops_the_match():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = list(range(12))  # exactly 3 full blocks
    _arrive(kv, "a", a)
    assert kv.reserve("same", 12, a) and kv.num_skipped_blocks("same") == 2  # 3rd holds the last token
    c = a[:4] + [99] + a[5:]  # block 1 differs: blocks 1, 2 cannot hit even though 2 matches
    kv.reserve("c", 12, c)
    assert kv.num_skipped_blocks("c") == 1
    kv.reserve("plain", 12)  # no prompt given: nothing matched
    assert kv.num_skipped_blocks("plain") == 0 and len(kv.transfer_block_ids("plain")) == 3
    kv.pool.check()


def test_failed_transfer_publishes_nothing_and_unpins():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = list(range(20))
    kv.reserve("a", 20, a)
    kv.free("a")  # its transfer failed: released before add_prefilled
    assert not kv.pool.cached and kv.num_free_blocks == 16
    _arrive(kv, "a2", a)
    kv.free("a2")
    assert len(kv.pool.cached) == 5  # now on the free LRU, findable
    kv.reserve("b", 20, a)
    assert kv.num_skipped_blocks("b") == 4
    kv.free("b")  # unpinned: back on the LRU, still cached
    assert kv.num_free_blocks == 16 and len(kv.pool.cached) == 5
    kv.pool.check()


def test_no_room_leaves_nothing_pinned_and_caching_off_matches_nothing():
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a = list(range(20))  # 5 blocks
    _arrive(kv, "a", a)
    kv.free("a")
    big = a[:16] + list(range(50, 58))  # 4 hits + 2 fresh needed, 1 uncached free block + LRU
    assert kv.reserve("big", len(big), big) is not None and kv.num_skipped_blocks("big") == 4
    kv.free("big")
    assert kv.reserve("huge", 24 + 8, big + [1] * 8) is None  # 4 hits + 4 fresh > 6
    assert kv.num_free_blocks == 6 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    off = KVCacheManager(8, BS, enable_prefix_caching=False)
    _arrive(off, "a", a)
    off.free("a")
    assert len(off.reserve("b", 20, a)) == 5 and off.num_skipped_blocks("b") == 0
    with pytest.raises(ValueError, match="prompt tokens"):
        off.reserve("c", 5, [1, 2])
    kv.pool.check()
    off.pool.check()


def _engine(prefix=True):
    return Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256),
                               cache=CacheConfig(num_blocks=64, enable_prefix_caching=prefix)))


def test_engine_sends_only_the_blocks_decode_lacks():
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    shared = list(range(3, 3 + 48))  # 3 full blocks of 16
    prompts = [shared + [60, 61, 62], shared + [70, 71, 72, 73, 74]]
    want = _engine(prefix=False).generate(prompts, params)
    pre, dec = _engine(), _engine()
    skipped = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        fresh = dec.reserve(rid, len(p), p)
        skip = -(-len(p) // 16) - len(fresh)
        skipped.append(skip)
        first = prefill_outputs(pre, rid, p, params)[-1].new_token_ids[0]
        kv = pre.export_kv(rid, skip)
        assert kv.num_blocks == len(fresh) == len(dec.reserved_block_ids(rid))
        pre.release(rid)
        dec.import_kv(rid, kv)
        assert dec.add_prefilled(rid, p, first, params) is None
        assert decode_to_end(dec, first) == want[i], f"prompt {i}"
    assert skipped == [0, 3]
    with pytest.raises(InvalidRequestError, match="prompt tokens"):
        dec.reserve("bad", 5, [1, 2, 3])
    prefill_outputs(pre, "x", prompts[0], params)
    with pytest.raises(ValueError, match="skip_blocks"):
        pre.export_kv("x", 4)


def test_publish_if_owner_only_for_the_current_reservation():
    dec = _engine()
    p = list(range(3, 3 + 40))  # 2 full blocks + 8 tokens
    dec.reserve("r", len(p), p)
    assert dec.publish_if_owner("r", "t-old", {"r": "t-new"}, p) == 0  # a newer reservation
    assert dec.publish_if_owner("r", "t1", {"r": "t1"}, p[:20]) == 0  # not the reserved prompt
    assert dec.publish_if_owner("r", "t1", {"r": "t1"}, p) == 2
    dec.release("r")
    assert len(dec.reserve("s", len(p), p)) == 1 and dec.kv.num_skipped_blocks("s") == 2
