"""Engine step timings on a GPU: decode steps (graph replay and eager), prefill throughput,
HF transformers eager on the same weights, and the memory/compute roofline.

Used by bench/engine_gpu.py; each function returns plain dicts for the JSON.
KV contents are random: step time does not depend on the values, only on the shapes.
"""
from __future__ import annotations


import torch

from bench.timing import cuda_time_ms
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.layers.attention import AttentionMetadata
from engine.runner import StepInput


def gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = cuda_time_ms(lambda: a @ b, iters=20)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def make_engine(shape: str, max_batch: int, max_ctx: int, eager: bool, backend: str = "auto",
                num_blocks: int | None = None, prefill_graphs: bool = True,
                skinny_max_batch: int | None = None) -> Engine:
    """skinny_max_batch: DeviceConfig.skinny_gemm_max_batch (None: the tuned table decides)."""
    bs = 16
    nb = num_blocks or (max_batch * (-(-max_ctx // bs)) + 8)
    cfg = EngineConfig(
        model=ModelConfig(model=f"dummy:{shape}", dtype="bf16", max_model_len=max_ctx + 64),
        cache=CacheConfig(block_size=bs, num_blocks=nb),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=8192),
        device=DeviceConfig(device="cuda", enforce_eager=eager, attention_backend=backend,
                            cuda_graph_max_batch=max_batch, skinny_gemm_max_batch=skinny_max_batch,
                            cuda_graph_max_prefill_tokens=(DeviceConfig.cuda_graph_max_prefill_tokens
                                                           if prefill_graphs else 0)))
    return Engine(cfg)


def decode_inputs(eng: Engine, batch: int, ctx: int):
    """A decode-only batch: `batch` sequences each with `ctx` tokens of context, disjoint blocks."""
    bs = eng.cfg.cache.block_size
    nblk = -(-(ctx + 1) // bs)
    dev = eng.runner.device
    bt = torch.arange(batch * nblk, dtype=torch.int32, device=dev).view(batch, nblk)
    pos = torch.full((batch,), ctx, dtype=torch.long, device=dev)
    slots = (bt[:, ctx // bs].long() * bs + ctx % bs)
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=bt,
        seq_lens=torch.full((batch,), ctx + 1, dtype=torch.int32, device=dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        max_query_len=1, max_seq_len=ctx + 1, block_size=bs,
        seq_lens_cpu=[ctx + 1] * batch, query_start_loc_cpu=list(range(batch + 1)),
        is_decode_only=True)
    ids = torch.randint(0, eng.arch.vocab_size, (batch,), device=dev)
    return ids, pos, meta


def rows_of(ids: torch.Tensor, meta: AttentionMetadata, ctx: int) -> list[StepInput]:
    """decode_inputs' batch as runner rows (what the serving path stages for a graph)."""
    bt = meta.block_tables.tolist()
    return [StepInput(f"b{i}", [int(t)], ctx, bt[i], True) for i, t in enumerate(ids.tolist())]


@torch.inference_mode()
def time_decode(eng: Engine, batch: int, ctx: int, eager: bool = True) -> dict:
    ids, pos, meta = decode_inputs(eng, batch, ctx)
    r = eng.runner
    res = {}
    if r.graphs is not None:
        # the serving path: runner rows staged on the host, one upload, replay
        rows = rows_of(ids, meta, ctx)
        for _ in range(30):  # settle clocks before the first timed case
            r.graphs.run_rows(rows)
        res["graph_ms"] = cuda_time_ms(lambda: r.graphs.run_rows(rows), iters=50)
        # the GPU's step alone: the staged bucket graph replayed (graph_ms above also holds
        # the host staging between its events, which jitters by ~3% from one timing to the
        # next; the overlapped serving loop hides it: lab/capture_variance.py)
        g = r.graphs
        b = g.bucket_for(batch)
        if b in g.graphs:
            res["replay_ms"] = cuda_time_ms(g.graphs[b].replay, iters=50)

    def eager_step():
        h = r.model(ids, pos, r.kv_caches, meta, r.kv_scales)
        return r.model.compute_logits(h)
    if eager:
        res["eager_ms"] = cuda_time_ms(eager_step, iters=10, warmup=2)
    return res


def prefill_inputs(eng: Engine, n_tokens: int):
    """One fresh prompt of n_tokens on blocks 0..: (ids, positions, meta, rows for the runner)."""
    bs = eng.cfg.cache.block_size
    dev = eng.runner.device
    nblk = -(-n_tokens // bs)
    bt = torch.arange(nblk, dtype=torch.int32, device=dev)[None]
    pos = torch.arange(n_tokens, device=dev)
    meta = AttentionMetadata(
        slot_mapping=(bt[0].long().repeat_interleave(bs)[:n_tokens] * bs + pos % bs),
        block_tables=bt, seq_lens=torch.tensor([n_tokens], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, n_tokens], dtype=torch.int32, device=dev),
        max_query_len=n_tokens, max_seq_len=n_tokens, block_size=bs,
        seq_lens_cpu=[n_tokens], query_start_loc_cpu=[0, n_tokens])
    ids = torch.randint(0, eng.arch.vocab_size, (n_tokens,), device=dev)
    rows = [StepInput("bench", ids.tolist(), 0, list(range(nblk)), True)]
    return ids, pos, meta, rows


@torch.inference_mode()
def time_prefill(eng: Engine, n_tokens: int, graphs: bool = False) -> float:
    """ms of one prefill step of n_tokens (one sequence, last row's logits).
    graphs=False: the eager model on prebuilt device tensors (host launch overhead included,
    host input building excluded). graphs=True: PrefillGraphRunner.run, i.e. host staging of
    the padded inputs + one upload + replay of the token bucket's graph; nan when no prefill
    graph takes n_tokens (graphs off, or above the largest bucket)."""
    ids, pos, meta, rows = prefill_inputs(eng, n_tokens)
    r = eng.runner
    if graphs:
        pg = r.prefill_graphs
        if pg is None or pg.plan(rows)[0] is None:
            return float("nan")
        return cuda_time_ms(lambda: pg.run(rows), iters=20, warmup=3)

    def run():
        h = r.model(ids, pos, r.kv_caches, meta, r.kv_scales)
        return r.model.compute_logits(h[-1:])
    return cuda_time_ms(run, iters=5, warmup=2)


def time_prefill_graphs(eng: Engine, lens=(128, 512, 2048)) -> list[dict]:
    """Prefill step time eager vs through the prefill graphs, per prompt length, for the JSON:
    [{"tokens", "bucket", "eager_ms", "graph_ms", "speedup"}]. Needs an engine built with
    graphs on (make_engine(..., eager=False)); its max_num_batched_tokens caps the buckets."""
    out = []
    pg = eng.runner.prefill_graphs
    for n in lens:
        eager = time_prefill(eng, n)
        graph = time_prefill(eng, n, graphs=True)
        rows = prefill_inputs(eng, n)[3]
        out.append({"tokens": n, "bucket": pg.plan(rows)[0] if pg is not None else None,
                    "eager_ms": round(eager, 3), "graph_ms": round(graph, 3),
                    "speedup": round(eager / graph, 2) if graph == graph else None})
    return out


def model_flops_per_token(arch, ctx: int) -> float:
    """Matmul FLOPs per token (2 * params in linear layers) + attention (4 * ctx * heads * d)."""
    a = arch
    d, f = a.hidden_size, a.intermediate_size
    per_layer = 2 * (d * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim * d
                     + 3 * d * f)
    attn = 4 * ctx * a.num_heads * a.head_dim
    return a.num_layers * (per_layer + attn) + 2 * d * a.vocab_size


def weight_bytes(model) -> int:
    """Weight bytes a decode step must read: every parameter, except that an untied input
    embedding is only gathered (one row per token), not streamed."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        e = model.embed_tokens
        total -= e.numel() * e.element_size()
    return total


def kv_bytes_per_token(arch, elem: int = 2) -> int:
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem


@torch.inference_mode()
def hf_decode_ms(eng: Engine, ctx: int, batch: int = 1) -> float | None:
    """HF transformers eager decode step (model forward) with its own KV cache, same shapes."""
    hf = _hf_model(eng)
    if hf is None:
        return None
    a = eng.arch
    ids = torch.randint(0, a.vocab_size, (batch, ctx), device="cuda")
    out = hf(ids, use_cache=True)
    past = out.past_key_values
    nxt = torch.randint(0, a.vocab_size, (batch, 1), device="cuda")
    # NOTE: a DynamicCache grows on every call; crop back so every timed step sees ctx tokens.
    def step():
        hf(nxt, past_key_values=past, use_cache=True)
        past.crop(ctx)
    t = cuda_time_ms(step, iters=10, warmup=3)
    del hf, past, out
    torch.cuda.empty_cache()
    return t


@torch.inference_mode()
def hf_generate_ms_per_token(eng: Engine, ctx: int, new_tokens: int = 32) -> float | None:
    """HF `generate` (greedy, its default dynamic cache) per generated token at ~ctx context:
    (time for 1 + new_tokens tokens - time for 1 token) / new_tokens, so the prompt's
    prefill cancels out. This is what a user of HF transformers gets per token."""
    hf = _hf_model(eng)
    if hf is None:
        return None
    a = eng.arch
    ids = torch.randint(0, a.vocab_size, (1, ctx), device="cuda")

    def gen(n):
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    t_long = cuda_time_ms(lambda: gen(1 + new_tokens), iters=3, warmup=1)
    t_short = cuda_time_ms(lambda: gen(1), iters=3, warmup=1)
    del hf
    torch.cuda.empty_cache()
    return (t_long - t_short) / new_tokens


def _hf_model(eng: Engine):
    try:
        import transformers
    except ImportError:
        return None
    a = eng.arch
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta, rope_scaling=a.rope_scaling,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(cfg)
    hf = hf.to_empty(device="cuda").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():  # random, not uninitialised memory (NaNs would skew nothing
            p.normal_(0, 0.02)     # in time, but keep the model well defined)
    return hf
