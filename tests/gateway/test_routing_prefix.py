"""Prefix-aware prefill routing: the gateway's per-replica index of block-prefix hash chains,
its weighing against load, and GatewayCore sending a shared prefix back to its replica."""
from engine.sampling_params import SamplingParams
from gateway.admission import AdmissionConfig, LoadView, Predictor
from gateway.routing import PrefixIndex, Replica, order_prefill
from gateway.types import GenRequest
from tests.gateway.conftest import make_stack


def test_index_matches_the_longest_leading_run_of_full_blocks():
    ix = PrefixIndex(block_size=4)
    a = list(range(100, 113))  # 13 tokens: 3 full blocks
    ix.record("r1", ix.hashes(a))
    assert len(ix.hashes(a)) == 3
    assert ix.match("r1", ix.hashes(a), len(a)) == 12
    assert ix.match("r2", ix.hashes(a), len(a)) == 0
    # exactly 3 blocks long: the last token is computed, so only 2 blocks can hit
    assert ix.match("r1", ix.hashes(a[:12]), 12) == 8
    # same second block after a different first one: no hit (a chain, not a bag of blocks)
    b = [1, 2, 3, 4] + a[4:]
    assert ix.match("r1", ix.hashes(b), len(b)) == 0
    # a prompt sharing the first 6 tokens hits its first full block only
    c = a[:6] + [7, 7, 7, 7, 7]
    assert ix.match("r1", ix.hashes(c), len(c)) == 4
    ix.set_block_size(8)
    assert ix.match("r1", ix.hashes(a), len(a)) == 0  # a new block size starts over


def test_index_is_an_lru_bounded_by_capacity():
    ix = PrefixIndex(block_size=2)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    ix.record("r", ix.hashes(old), capacity=2)
    ix.record("r", ix.hashes(new), capacity=2)
    assert ix.match("r", ix.hashes(old), 5) == 0 and ix.match("r", ix.hashes(new), 5) == 4
    ix.forget("r")
    assert ix.match("r", ix.hashes(new), 5) == 0


def test_cache_hit_weighed_against_load():
    p = Predictor(AdmissionConfig(prefill_tokens_per_s=1000.0, transfer_ms_per_token=0.0))
    holder = Replica("holder:1", "prefill", load=LoadView(queued_tokens=300))
    idle = Replica("idle:1", "prefill", load=LoadView())
    # 1000-token prompt, 960 cached on the busy holder: 300 + 40 tokens there < 1000 here
    assert order_prefill([idle, holder], p, 1000, {"holder:1": 960})[0] is holder
    # the holder's queue grows past what the hit saves: the idle replica wins
    holder.load.queued_tokens = 2000
    assert order_prefill([idle, holder], p, 1000, {"holder:1": 960})[0] is idle


async def test_core_routes_a_shared_prefix_to_the_replica_that_holds_it():
    s = await make_stack(n_prefill=2)
    try:
        core = s.core
        r0, r1 = core.prefill.replicas

        async def send(text):
            before = [fp.calls for fp in s.prefills]
            r = GenRequest(core.new_request_id(), core.tokenizer.encode(text),
                           SamplingParams(temperature=0.0, max_tokens=2))
            _ = [c async for c in core.generate(r)]
            return [b != a.calls for a, b in zip(s.prefills, before)].index(True)

        a, b = "A" * 64, "B" * 64  # two 64-token system prompts (4 blocks each)
        r0.load.queued_tokens = 50  # replica 0 busy for a moment: A's first request goes to 1
        assert await send(a + "first") == 1
        r0.load.queued_tokens, r1.load.queued_tokens = 0, 20
        # replica 1 is now the busier one, yet A's 64 cached tokens outweigh its 20 queued
        assert [await send(a + f"q{i}") for i in range(5)] == [1] * 5
        assert await send(b + "first") == 0  # nobody holds B: the less busy replica
        r0.load.queued_tokens, r1.load.queued_tokens = 20, 0
        assert [await send(b + f"q{i}") for i in range(3)] == [0] * 3
        body = core.metrics.render()[0].decode()
        # 8 requests repeated a prefix; each was expected to hit its 4 cached blocks
        assert 'splitserve_routing_prefix_tokens_total{kind="predicted"} 512.0' in body
    finally:
        await s.close()
