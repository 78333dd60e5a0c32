"""Prefill CUDA graphs, the parts that run without a GPU: token buckets, fallback rules, the
padded static inputs, and the runner's routing and counters.

Graph capture needs CUDA; here each captured graph is stood in for by `EagerReplay`, which
"replays" by running the same recorded computation eagerly over the same static buffers.
What that checks on CPU: the padding (tokens outside every sequence, empty padding sequences,
slot -1, the sampled-row gather) gives the eager engine's logits and tokens, and every step is
routed and counted as it should be. tests/gpu/test_gpu_prefill_graphs.py checks real replays.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import (CacheConfig, ConfigError, DeviceConfig, EngineConfig, ModelConfig,
                           SchedulerConfig)
from engine.engine import Engine
from engine.graphs_decode import DecodeGraphRunner
from engine.graphs_prefill import (PrefillGraphRunner, PrefillStaging, plan_prefill,
                                   prefill_buckets)
from engine.runner import StepInput, prefill_graph_max_tokens
from engine.sampling_params import SamplingParams


# ---- buckets ------------------------------------------------------------------------------
def test_prefill_buckets_default_and_edges():
    assert prefill_buckets(2048) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320,
                                     384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    assert prefill_buckets(100) == [16, 32, 48, 64, 80, 96, 100]  # the limit is always a bucket
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(10) == [10]
    assert prefill_buckets(0) == []


def test_prefill_bucket_padding_waste_bounded():
    bk = prefill_buckets(4096)
    for n in range(1, 4097):
        b = next(x for x in bk if x >= n)
        if n > 128:  # compute-bound region: padding costs real FLOPs
            assert (b - n) / n < 0.25, (n, b)
        else:
            assert b - n < 16, (n, b)


def test_prefill_graph_limit_follows_config():
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=512))
    assert prefill_graph_max_tokens(cfg) == 512  # default 2048 capped by the token budget
    cfg = EngineConfig(device=DeviceConfig(cuda_graph_max_prefill_tokens=256))
    assert prefill_graph_max_tokens(cfg) == 256
    cfg = EngineConfig(device=DeviceConfig(cuda_graph_max_prefill_tokens=0))
    assert prefill_graph_max_tokens(cfg) == 0


@pytest.mark.parametrize("kw,msg", [
    ({"cuda_graph_max_prefill_tokens": -1}, "cuda_graph_max_prefill_tokens"),
    ({"cuda_graph_max_prefill_seqs": 0}, "cuda_graph_max_prefill_seqs"),
    ({"cuda_graph_max_batch": 0}, "cuda_graph_max_batch"),
])
def test_graph_config_validated(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        DeviceConfig(**kw)


# ---- fallback rules -------------------------------------------------------------------------
BK = prefill_buckets(256)  # ... 224, 256


@pytest.mark.parametrize("tokens,seqs,ctx,captured,want", [
    (1, 1, 1, BK, (16, None)),
    (16, 8, 40, BK, (16, None)),
    (17, 3, 40, BK, (32, None)),
    (200, 8, 1000, BK, (224, None)),
    (256, 8, 1024, BK, (256, None)),        # the largest bucket itself
    (257, 1, 257, BK, (None, "tokens")),    # above the largest bucket
    (100, 9, 100, BK, (None, "seqs")),      # more sequences than a graph holds
    (100, 2, 1025, BK, (None, "blocks")),   # context longer than the static block table
    (100, 2, 100, [b for b in BK if b != 112], (None, "no_graph")),  # that capture failed
    (300, 9, 100, BK, (None, "tokens")),    # tokens are checked first
])
def test_plan_prefill(tokens, seqs, ctx, captured, want):
    assert plan_prefill(tokens, seqs, ctx, BK, set(captured), max_seqs=8, max_context=1024) == want


# ---- padded static inputs ---------------------------------------------------------------------
BS = 16
ROWS = [
    StepInput("fresh", [11, 12, 13, 14, 15], 0, [7], True),          # new prompt, 5 tokens
    StepInput("prefix", [21, 22, 23], 18, [3, 9], False),            # 18 cached, chunk not sampled
    StepInput("decode", [31], 40, [1, 2, 5, 6], True),               # decode row, spare block
]


def test_staging_pads_mixed_batch():
    st = PrefillStaging(max_tokens=32, max_seqs=6, max_blocks=4, device=torch.device("cpu"))
    got = st.stage(ROWS, BS, bucket=16, seqs=6)
    assert (got.num_tokens, got.num_seqs, got.num_sampled) == (9, 3, 2)
    h = st.h
    pad = 16 - 9
    assert h.input_ids[:16].tolist() == [11, 12, 13, 14, 15, 21, 22, 23, 31] + [0] * pad
    assert h.positions[:16].tolist() == [0, 1, 2, 3, 4, 18, 19, 20, 40] + [0] * pad
    # slot = block_table[pos // 16] * 16 + pos % 16; padding tokens are never written
    assert h.slot_mapping[:16].tolist() == ([7 * 16 + i for i in range(5)]
                                            + [9 * 16 + 2, 9 * 16 + 3, 9 * 16 + 4]
                                            + [5 * 16 + 8] + [-1] * pad)
    # padding sequences own no query rows: they repeat the token count
    assert h.query_start_loc[:7].tolist() == [0, 5, 8, 9, 9, 9, 9]
    assert h.seq_lens[:6].tolist() == [5, 21, 41, 0, 0, 0]
    # sampled rows: last token of "fresh" (row 4) and of "decode" (row 8); padding -> row 0
    assert h.sample_idx[:6].tolist() == [4, 8, 0, 0, 0, 0]
    # only the blocks a context covers are written (the decode row's spare block 6 is not)
    assert h.block_tables[0, :1].tolist() == [7]
    assert h.block_tables[1, :2].tolist() == [3, 9]
    assert h.block_tables[2, :3].tolist() == [1, 2, 5]
    st.upload(got.num_seqs)
    d = st.d
    assert torch.equal(d.input_ids, torch.from_numpy(h.input_ids))
    assert torch.equal(d.query_start_loc, torch.from_numpy(h.query_start_loc))
    assert torch.equal(d.block_tables[:3], torch.from_numpy(h.block_tables[:3]))


def test_staging_matches_eager_metadata_and_leaves_nothing_stale():
    """The unpadded prefix equals what the eager path builds; a smaller batch staged after a
    bigger one leaves no stale token, slot, sequence or sample entry inside its bucket."""
    eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                              cache=CacheConfig(num_blocks=16), device=DeviceConfig(device="cpu")))
    ids, pos, meta, logits_idx = eng.runner.build_metadata(ROWS)
    st = PrefillStaging(max_tokens=32, max_seqs=6, max_blocks=8, device=torch.device("cpu"))
    big = [StepInput(f"r{i}", list(range(100, 105)), 16 * i, list(range(i + 2)), True)
           for i in range(6)]
    st.stage(big, BS, bucket=32, seqs=6)
    st.stage(ROWS, BS, bucket=16, seqs=6)
    h = st.h
    n = ids.shape[0]
    assert h.input_ids[:n].tolist() == ids.tolist()
    assert h.positions[:n].tolist() == pos.tolist()
    assert h.slot_mapping[:n].tolist() == meta.slot_mapping.tolist()
    assert h.query_start_loc[:4].tolist() == meta.query_start_loc.tolist()
    assert h.seq_lens[:3].tolist() == meta.seq_lens.tolist()
    assert h.sample_idx[:2].tolist() == logits_idx
    assert (h.slot_mapping[n:16] == -1).all() and (h.input_ids[n:16] == 0).all()
    assert (h.query_start_loc[4:7] == n).all() and (h.seq_lens[3:6] == 0).all()
    assert (h.sample_idx[2:6] == 0).all()


def test_staging_rejects_what_does_not_fit():
    st = PrefillStaging(max_tokens=16, max_seqs=2, max_blocks=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        st.stage(ROWS, BS, bucket=16, seqs=2)  # 3 sequences
    with pytest.raises(ValueError, match="blocks for"):
        st.stage([StepInput("x", [1] * 3, 15, [4], True)], BS, bucket=16, seqs=2)  # needs 2 blocks


# ---- the runner with stand-in graphs ---------------------------------------------------------
class EagerReplay:
    """Stands in for a captured CUDA graph on CPU: replay() runs the recorded computation
    eagerly over the runner's static buffers (what a real replay does on the GPU)."""

    def __init__(self, runner, bucket):
        self.runner, self.bucket = runner, bucket

    def replay(self):
        out = self.runner._forward(self.bucket)
        if out is not None:
            self.runner.outputs[self.bucket] = out


def _install(runner, skip=()):
    runner.graphs = {b: EagerReplay(runner, b) for b in runner.buckets if b not in skip}
    return runner


def _engine(max_seqs=8, budget=64):
    return Engine(EngineConfig(
        model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=256, seed=3),
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
        device=DeviceConfig(device="cpu")))


def _with_graphs(eng, max_tokens=48, max_seqs=3, decode_batch=2, skip=()):
    r = eng.runner
    max_blocks = -(-eng.max_model_len // r.block_size)
    r.prefill_graphs = _install(PrefillGraphRunner(
        r.model, r.kv_caches, r.kv_scales, max_tokens, max_seqs, max_blocks, r.block_size,
        eng.arch.vocab_size, r.device), skip)
    r.graphs = _install(DecodeGraphRunner(r.model, r.kv_caches, r.kv_scales, decode_batch,
                                          max_blocks, r.block_size, r.device))
    return eng


PROMPTS = [list(range(1, 1 + n)) for n in (5, 30, 60, 9, 17, 3)]


def test_generate_through_padded_graph_inputs_equals_eager():
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = _engine(max_seqs=4).generate(PROMPTS, params)
    eng = _with_graphs(_engine(max_seqs=4), decode_batch=4)
    got = eng.generate(PROMPTS, params)
    assert got == want
    m = eng.stats()
    pg, dg = eng.runner.prefill_graphs, eng.runner.graphs
    print({k: v for k, v in m.items() if k.startswith("cuda_graph")})
    assert pg.replays > 0 and dg.replays > 0, (pg.replays, dg.replays)
    # 64-token budget vs a 48-token largest bucket; 4 running sequences vs 3 per graph
    # (the prompts share prefixes: later ones start from cached blocks)
    assert pg.fallback_counts["tokens"] > 0 and pg.fallback_counts["seqs"] > 0, pg.fallback_counts
    assert m["cuda_graph_replay_total"] == pg.replays + dg.replays
    assert m["cuda_graph_prefill_replay_total"] == pg.replays
    assert m["cuda_graph_decode_replay_total"] == dg.replays
    assert m["cuda_graph_eager_fallback_total"] == pg.fallbacks + dg.fallbacks
    assert m["cuda_graph_prefill_fallback_seqs_total"] == pg.fallback_counts["seqs"]
    assert m["cuda_graph_captured_count"] == len(pg.buckets) + len(dg.buckets)


def _greedy_batch(eng, rows):
    from engine.request import Request

    reqs = [Request(r.request_id, r.token_ids, SamplingParams(temperature=0.0)) for r in rows
            if r.sample]
    return eng.runner.sampling_batch(reqs) if reqs else None


def test_runner_routes_and_counts_each_step():
    eng = _with_graphs(_engine(), skip=(32,))
    r = eng.runner
    pg, dg = r.prefill_graphs, r.graphs

    def counters():
        return {"prefill": pg.replays, "decode": dg.replays,
                **{f"prefill:{k}": v for k, v in pg.fallback_counts.items()},
                **{f"decode:{k}": v for k, v in dg.fallback_counts.items()}}

    def step(rows):
        """-> the one counter this step moved (a replay of a kind, or a fallback reason)."""
        before = counters()
        out, logits = r.execute(rows, _greedy_batch(eng, rows))
        n_sampled = sum(x.sample for x in rows)
        assert (logits is None) == (n_sampled == 0)
        assert out is None or len(out.token_ids) == n_sampled
        moved = [k for k, v in counters().items() if v != before[k]]
        assert len(moved) == 1, f"one outcome per step, got {moved}"
        return moved[0]

    blk = iter(range(128))

    def row(n, start=0, sample=True):
        ids = [next(blk) for _ in range(-(-(start + n) // 16))]
        return StepInput("r", list(range(7, 7 + n)), start, ids, sample)

    assert step([row(10), row(1, 20)]) == "prefill"                       # mixed, bucket 16
    assert step([row(40, 16, sample=False)]) == "prefill"                 # chunk, nothing sampled
    assert step([row(1, 5), row(1, 9)]) == "decode"                       # decode-only
    assert step([row(1, 5), row(1, 9), row(1, 3)]) == "decode:batch"      # > 2 decode rows
    assert step([row(1, 5), row(1, 9, sample=False)]) == "prefill"        # not all rows sample
    assert step([row(49)]) == "prefill:tokens"                            # > 48 tokens
    assert step([row(2), row(2), row(2), row(2)]) == "prefill:seqs"       # > 3 sequences
    assert step([row(20), row(5)]) == "prefill:no_graph"                  # bucket 32 not captured
    assert pg.fallback_counts == {"tokens": 1, "seqs": 1, "blocks": 0, "no_graph": 1}


def test_graph_logits_equal_eager_on_mixed_batch():
    """Sampled-row logits through the padded static inputs == the eager engine's (fp32 CPU)."""
    eng = _with_graphs(_engine())
    r = eng.runner
    rows = [StepInput("a", list(range(3, 20)), 0, [0, 1], True),
            StepInput("b", [5, 6, 7], 16, [2, 3], True),   # attends to block 2 (whatever is there)
            StepInput("c", [9], 30, [4, 5], True)]
    torch.manual_seed(0)
    for kv in r.kv_caches:
        kv.normal_()
    snapshot = [kv.clone() for kv in r.kv_caches]
    g = r.prefill_graphs.run(rows)
    assert g is not None and g.shape == (3, eng.arch.vocab_size)
    assert r.prefill_graphs.last.bucket == 32
    for kv, s in zip(r.kv_caches, snapshot):
        kv.copy_(s)
    ids, pos, meta, idx = r.build_metadata(rows)
    with torch.inference_mode():
        want = r.model.compute_logits(r.model(ids, pos, r.kv_caches, meta)[idx])
    torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-5)
    # the padded run wrote exactly the real tokens' KV: same cache as the eager run
    after_eager = [kv.clone() for kv in r.kv_caches]
    for kv, s in zip(r.kv_caches, snapshot):
        kv.copy_(s)
    r.prefill_graphs.run(rows)
    for a, b in zip(r.kv_caches, after_eager):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_no_sampled_rows_replays_without_logits():
    eng = _with_graphs(_engine())
    out, logits = eng.runner.execute([StepInput("x", list(range(1, 20)), 0, [0, 1], False)], None)
    assert out is None and logits is None and eng.runner.prefill_graphs.replays == 1


def test_sample_idx_padding_points_at_valid_rows():
    st = PrefillStaging(max_tokens=64, max_seqs=8, max_blocks=4, device=torch.device("cpu"))
    got = st.stage([StepInput("x", [1] * 3, 0, [0], False)], BS, bucket=16, seqs=8)
    assert got.num_sampled == 0
    assert np.all((st.h.sample_idx[:8] >= 0) & (st.h.sample_idx[:8] < 16))
