"""ModelRunner: owns weights, the paged KV cache tensors and the attention backend; runs one
scheduled batch (prefill chunks and decodes mixed) and returns the sampled tokens.

It knows nothing about request lifecycles: the scheduler decides what runs, the runner turns
that into flat tensors (input ids, positions, slot mapping, block tables) and calls the model.

CUDA graphs (cuda device, a graph-safe attention backend, not enforce_eager): one step runs
  - a decode-only batch (every row 1 token and sampled) -> decode graph of its batch bucket
    (engine/graphs_decode.py), else eager (counted as a decode fallback);
  - any other batch -> prefill graph of its token bucket (engine/graphs_prefill.py), else
    eager (counted as a prefill fallback, by reason).
Both kinds share one memory pool; see engine/graphs.py.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.graphs import put_tokens
from engine.kernels.common import interpreting  # no triton import: safe on CPU
from engine.kv_memory import allocate_pool
from engine.layers.attention import AttentionMetadata, KVScales
from engine.layers.sampler import Sampler, SamplingBatch

log = logging.getLogger("splitserve.engine.runner")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_PACKED_MAX_BYTES = 2 << 30  # DeviceConfig.cpu_packed_matmul auto: fp32 weights up to this


def set_interop_threads(n: int) -> None:
    """torch's inter-op pool size; it can be set once per process, before any inter-op work
    (a second engine in the process keeps the first one's)."""
    if torch.get_num_interop_threads() == n:
        return
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return _DTYPES[name]


def resolve_kv_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    if name == "auto":
        return compute
    if name == "fp8_e4m3":
        return torch.float8_e4m3fn
    return _DTYPES[name]


@dataclass
class StepInput:
    """One row per scheduled sequence: the tokens to feed this step."""
    request_id: str
    token_ids: list[int]  # tokens at positions start .. start + len - 1
    start: int  # num_computed_tokens before this step
    block_ids: list[int]
    sample: bool

    @classmethod
    def of_request(cls, req, start: int, num_tokens: int, block_ids: list[int], sample: bool
                   ) -> "StepInput":
        """A row fed from the request's own tokens (known on the host): positions start ..
        start + num_tokens - 1."""
        return cls(req.request_id, req.all_token_ids[start:start + num_tokens], start, block_ids, sample)


def prefill_graph_max_tokens(cfg: EngineConfig) -> int:
    """Largest prefill graph bucket: a step never holds more than max_num_batched_tokens."""
    return min(cfg.device.cuda_graph_max_prefill_tokens, cfg.scheduler.max_num_batched_tokens)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model, arch, device: str, dtype: torch.dtype):
        self.cfg = cfg
        self.model = model
        self.arch = arch
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = cfg.cache.block_size
        self.kv_dtype = resolve_kv_dtype(cfg.cache.kv_cache_dtype, dtype)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: KVScales | None = None
        self.num_blocks = 0
        self.step_times: list[float] = []
        self.graphs = None  # DecodeGraphRunner once captured
        self.prefill_graphs = None  # PrefillGraphRunner once captured
        model.set_kernels(cfg.kernels)
        model.skinny_max_m, model.skinny_rows = self._skinny_batches()
        # NOTE: the fused Triton matmuls need [out, in] weights; under the Triton interpreter
        # (tests) they may run on CPU
        self.packed_head: torch.Tensor | None = None  # CPU: the LM head's oneDNN copy
        self.head_packed_min_rows = 2  # rows from which the LM head uses packed_head (cpu_gemv)
        self.skinny_head: torch.Tensor | None = None  # CPU: the LM head in cpu_skinny's order
        self.cpu_skinny = None
        if self.device.type == "cpu" and not interpreting():
            self._cpu_setup(model)

    def _cpu_setup(self, model) -> None:
        from engine import cpu_matmul
        from engine.cpu_layout import transpose_linear_weights

        d = self.cfg.device
        set_interop_threads(d.cpu_interop_threads or 1)
        want = d.cpu_packed_matmul
        if want == "auto":
            want = "on" if (self.dtype == torch.float32 and cpu_matmul.available()
                            and cpu_matmul.linear_weights_bytes(model) <= CPU_PACKED_MAX_BYTES) else "off"
        if want == "on":  # NOTE: packs from the contiguous [out, in] weights, before the layout
            self.packed_head = cpu_matmul.pack_model(model)
        if d.cpu_weight_layout:
            transpose_linear_weights(model)
        if d.cpu_kernels != "torch" and self.dtype == torch.float32:
            from engine.layers import cpu_ops

            ops = cpu_ops.make(d.cpu_kernels)
            for mod in model.modules():
                if hasattr(type(mod), "cpu_ops"):
                    mod.cpu_ops = ops
        if d.cpu_kernels != "torch" and want == "on":  # decode steps: the C kernel's own weight copy
            from engine.layers import cpu_skinny
            from engine.layers.linear import Linear

            self.cpu_skinny = cpu_skinny.make(d.cpu_kernels)
            if self.cpu_skinny is not None:
                for mod in model.modules():
                    if isinstance(mod, Linear) and mod.weight.dtype == torch.float32:
                        mod.skinny, mod.cpu_skinny = cpu_skinny.pack(mod.weight), self.cpu_skinny
                self.skinny_head = cpu_skinny.pack(model.lm_head_weight)
                return  # the one-row choice below only concerns rows the kernel now serves
        if d.cpu_one_row_matmul == "auto" and want == "on":  # a choice only where packed copies exist
            from engine import cpu_gemv

            _, self.head_packed_min_rows = cpu_gemv.setup(model, self.packed_head)

    def _skinny_batches(self) -> tuple[int, frozenset[int] | None]:
        """(max rows, the row counts <= max that take the fused path or None for all)."""
        want = self.cfg.device.skinny_gemm_max_batch
        if self.device.type != "cuda" or want == 0:
            return 0, None
        try:
            from engine.kernels.skinny_configs import tuned_max_m, tuned_rows
        except ImportError:  # no triton: cuBLAS everywhere
            log.warning("skinny GEMM kernels unavailable (triton import failed): decode uses cuBLAS")
            return 0, None
        # an explicit --skinny-gemm-max-batch means every batch up to it
        table = self.cfg.kernels.skinny_table
        m, rows = (want, None) if want is not None else (tuned_max_m(self.device, table),
                                                         tuned_rows(self.device, table))
        if rows is None:
            log.info("decode matmuls: fused skinny-GEMM kernels for batches <= %d, cuBLAS above", m)
        else:
            log.info("decode matmuls: fused skinny-GEMM kernels for batches %s (tuned), cuBLAS otherwise",
                     format_ranges(sorted(rows)))
        return m, rows

    # ---- KV cache -------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        a = self.arch
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim * elem

    def plan_num_blocks(self, max_model_len: int) -> int:
        c = self.cfg.cache
        if c.num_blocks is not None:
            return c.num_blocks
        per_block = self.bytes_per_block()
        if c.kv_cache_bytes is not None:
            budget = c.kv_cache_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * c.gpu_memory_utilization) - used
        else:
            # CPU: enough for every sequence at full length, capped at 1 GiB
            need = self.cfg.scheduler.max_num_seqs * max_model_len // self.block_size + 1
            budget = min(CPU_DEFAULT_KV_BYTES, need * per_block)
        n = budget // per_block
        if n < 2:
            raise MemoryError(f"KV cache budget {budget} B holds fewer than 2 blocks of {per_block} B")
        return int(n)

    def allocate_kv(self, num_blocks: int) -> None:
        a = self.arch
        # one allocation for every layer: a peer maps it whole (engine/kv_memory.py) and a
        # block's layers move in one gather (kv_block_view)
        shape = (a.num_layers, 2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        self.kv_pool = allocate_pool(math.prod(shape) * elem, self.device, self.cfg.cache.shareable)
        self.kv_caches = list(self.kv_pool.tensor.view(self.kv_dtype).view(shape).unbind(0))
        if self.kv_dtype == torch.float8_e4m3fn:
            self.kv_scales = KVScales(a.num_layers, self.device)
        self.num_blocks = num_blocks
        log.info("kv cache: %d blocks x %d tokens, %s, %.1f MiB", num_blocks, self.block_size,
                 str(self.kv_dtype).removeprefix("torch."), num_blocks * self.bytes_per_block() / 2**20)

    def kv_block_view(self) -> torch.Tensor:
        """The KV pool as uint8 [num_layers * 2, num_blocks, block_bytes] (K and V of each layer)."""
        return self.kv_pool.tensor.view(2 * self.arch.num_layers, self.num_blocks, -1)

    def maybe_capture_graphs(self, max_model_len: int, backend_name: str) -> None:
        d = self.cfg.device
        if self.device.type != "cuda" or d.enforce_eager:
            return
        if backend_name == "torch":
            log.info("cuda graphs off: the torch attention backend is not graph-safe")
            return
        from engine.graphs_decode import DecodeGraphRunner
        from engine.graphs_prefill import PrefillGraphRunner

        sched = self.cfg.scheduler
        max_batch = min(d.cuda_graph_max_batch or sched.max_num_seqs, sched.max_num_seqs)
        max_blocks = -(-max_model_len // self.block_size)
        if self.kv_scales is not None:
            self._calibrate_fp8()
        # a re-capture (e.g. after changing the model's matmul path) frees the old graphs first
        self.graphs = self.prefill_graphs = None
        # NOTE: one pool for both kinds, largest activations first: prefill buckets (up to
        # thousands of tokens) before decode buckets (up to max_num_seqs rows).
        pool = torch.cuda.graph_pool_handle()
        max_tokens = prefill_graph_max_tokens(self.cfg)
        if max_tokens > 0:
            self.prefill_graphs = PrefillGraphRunner(
                self.model, self.kv_caches, self.kv_scales, max_tokens,
                min(d.cuda_graph_max_prefill_seqs, sched.max_num_seqs), max_blocks,
                self.block_size, self.arch.vocab_size, self.device, pool=pool)
            self.prefill_graphs.capture()
        self.graphs = DecodeGraphRunner(self.model, self.kv_caches, self.kv_scales, max_batch,
                                        max_blocks, self.block_size, self.device, pool=pool)
        self.graphs.capture()

    def graph_metrics(self) -> dict:
        """Graph counters of both kinds (totals + per kind); {} when graphs are off."""
        from engine.graphs import graph_metrics

        return graph_metrics([self.prefill_graphs, self.graphs])

    @torch.inference_mode()
    def _calibrate_fp8(self) -> None:
        # NOTE: fp8 scales freeze at their first write; calibrate on a real forward before
        # graph capture so the capture's dummy inputs never set them. Block 0 is scratch here.
        n = min(self.block_size, 16)
        rows = [StepInput("calib", list(range(1, n + 1)), 0, [0], True)]
        ids, pos, meta, _ = self.build_metadata(rows)
        self.model(ids, pos, self.kv_caches, meta, self.kv_scales)

    # ---- one step ---------------------------------------------------------------------
    def build_metadata(self, rows: list[StepInput]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens = []
        logits_idx = []
        for r in rows:
            n = len(r.token_ids)
            ids.extend(r.token_ids)
            for p in range(r.start, r.start + n):
                pos.append(p)
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(r.start + n)
            if r.sample:
                logits_idx.append(qsl[-1] - 1)
        max_blocks = max((len(r.block_ids) for r in rows), default=1)
        bt = torch.zeros((len(rows), max(max_blocks, 1)), dtype=torch.int32)
        for i, r in enumerate(rows):
            if r.block_ids:
                bt[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=bt.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(rows))),
            max_seq_len=max(seq_lens),
            block_size=bs,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=qsl,
            is_decode_only=all(len(r.token_ids) == 1 for r in rows),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, meta, logits_idx

    @torch.inference_mode()
    def execute(self, rows: list[StepInput], sampling: SamplingBatch | None):
        """Run one forward; return (SamplerOutput or None, logits of sampled rows or None)."""
        t0 = time.perf_counter()
        logits = self._replay(rows)
        if logits is None:
            logits = self._eager_logits(rows)
        elif logits.shape[0] == 0:
            logits = None  # a replayed step in which no row samples
        out = self.sampler(logits, sampling) if logits is not None else None
        # the sampler's host copy of token ids already synchronized with the device
        self.record_step_time(t0)
        return out, logits

    @torch.inference_mode()
    def launch_overlapped(self, rows: list[StepInput], sampling: SamplingBatch | None,
                          token_src: torch.Tensor | None = None,
                          token_pos: list[int] | None = None
                          ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """A step run and sampled on the device without waiting for it: returns the sampled
        rows' token ids [n] as a device tensor, and Sampler.logprobs_device's tensors for the
        rows that ask for logprobs (None when none does). Rows: decode rows and prompt
        chunks (a chunk before a prompt's last samples nothing; sampling None: no row samples).
        token_src: the input ids of the decode rows that continue the previous step, as a
        device tensor (its sampled tokens, not yet on the host: engine/overlap.py); token_pos:
        their flat positions among the step's input ids (None: the leading ones)."""
        logits = self._replay(rows, token_src, token_pos)
        decode_graph = logits is not None and self.graphs is not None and self._decode_rows(rows)
        if logits is None:
            logits = self._eager_logits(rows, token_src, token_pos)
        if sampling is None:  # earlier chunks of prompts only: nothing to sample
            return torch.empty(0, dtype=torch.long, device=self.device), None
        if decode_graph and sampling.greedy_only:
            tokens = self.graphs.greedy_tokens(len(rows))  # the graph's own argmax
        else:
            tokens = self.sampler.tokens(logits, sampling)
        # NOTE: enqueued before anything else can replay over these logits
        return tokens, self.sampler.logprobs_device(logits, tokens, sampling)

    def _replay(self, rows: list[StepInput], token_src: torch.Tensor | None = None,
                token_pos: list[int] | None = None) -> torch.Tensor | None:
        """Logits of the sampled rows from a graph replay, or None: run eager.
        token_src / token_pos: device input ids of decode rows (launch_overlapped)."""
        if self.graphs is not None and self._decode_rows(rows):
            return self.graphs.run_rows(rows, token_src, token_pos)
        if self.prefill_graphs is not None:
            return self.prefill_graphs.run(rows, token_src, token_pos)
        return None

    @staticmethod
    def _decode_rows(rows: list[StepInput]) -> bool:
        """Every row one token and sampled: a decode graph's batch."""
        return all(len(r.token_ids) == 1 and r.sample for r in rows)

    def _eager_logits(self, rows: list[StepInput], token_src: torch.Tensor | None = None,
                      token_pos: list[int] | None = None) -> torch.Tensor | None:
        """The eager model: logits of the sampled rows, or None when no row samples.
        token_src / token_pos: device input ids of decode rows (launch_overlapped)."""
        input_ids, positions, meta, logits_idx = self.build_metadata(rows)
        if token_src is not None:
            put_tokens(input_ids, token_src, token_pos)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.kv_scales)
        if not logits_idx:
            return None
        idx = torch.tensor(logits_idx, dtype=torch.long, device=self.device)
        if self.skinny_head is not None and len(logits_idx) <= self.cpu_skinny.max_rows:
            w = self.model.lm_head_weight
            out = self.cpu_skinny(hidden.index_select(0, idx), self.skinny_head, w.shape[0])
            if out is not None:
                return out
        if self.packed_head is not None:
            from engine.cpu_matmul import logits

            return logits(hidden.index_select(0, idx), self.model.lm_head_weight, self.packed_head,
                          self.head_packed_min_rows)
        return self.model.compute_logits(hidden.index_select(0, idx))

    def record_step_time(self, t0: float) -> None:
        """A finished step's wall time since t0 (the last 64 are kept, for stats)."""
        self.step_times.append(time.perf_counter() - t0)
        del self.step_times[:-64]

    def sampling_batch(self, reqs, ahead: list[int] | None = None) -> SamplingBatch:
        return SamplingBatch.from_requests(reqs, self.arch.vocab_size, self.device, ahead)


def format_ranges(xs: list[int]) -> str:
    """[1, 2, 3, 9, 10] -> '1-3,9-10'."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) or "none"
