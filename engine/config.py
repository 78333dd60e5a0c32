"""Frozen engine configuration, validated on construction.

Every service composes an `EngineConfig` from these once in `main()`; nothing
below reads the environment (see `engine.envs` for that).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kernels.options import DecodeTile, KernelOptions  # noqa: F401 (re-exported)

KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3")
# --async-scheduling choices -> SchedulerConfig.async_scheduling
ASYNC_SCHEDULING = {"auto": None, "on": True, "off": False}
DTYPES = ("auto", "bf16", "fp16", "fp32")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
CPU_PACKED_MATMUL = ("auto", "on", "off")


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    # "default" (embedded SmolLM2-135M-Instruct GGUF), a HF directory, a .gguf file,
    # or "dummy:<shape>" (random weights, shapes in engine.loader.dummy.SHAPES).
    model: str = "default"
    dtype: str = "auto"  # auto -> bf16 on cuda, fp32 on cpu
    max_model_len: int | None = None  # None -> the model's own context length
    seed: int = 0
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        _check(bool(self.model), "model must be a non-empty string")
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.max_model_len is None or self.max_model_len >= 1,
               f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.90
    # An explicit KV byte budget wins over gpu_memory_utilization; on CPU a default applies.
    kv_cache_bytes: int | None = None
    num_blocks: int | None = None  # explicit block count wins over both
    enable_prefix_caching: bool = True
    # The KV pool in memory another process of the host can map (engine/kv_memory.py), for the
    # pool KV-transfer backends (vmm, shm); plain torch memory otherwise.
    shareable: bool = False

    def __post_init__(self) -> None:
        _check(self.block_size in (16, 32), f"block_size must be 16 or 32, got {self.block_size}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(0.0 < self.gpu_memory_utilization <= 1.0,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes must be > 0")
        _check(self.num_blocks is None or self.num_blocks >= 2, "num_blocks must be >= 2")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # A prompt chunk never exceeds this many tokens (<= max_num_batched_tokens).
    long_prefill_token_threshold: int | None = None
    # Overlapped decode (engine/overlap.py): launch the next decode step before the current
    # step's tokens reach the host. None: on for CUDA devices, off on CPU (nothing overlaps).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 1,
               "long_prefill_token_threshold must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size == 1, "only tensor_parallel_size=1 is supported")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # auto -> cuda if available else cpu
    enforce_eager: bool = False
    attention_backend: str = "auto"
    # CUDA-graph buckets: decode batch sizes up to cuda_graph_max_batch (None: max_num_seqs);
    # prefill/mixed token counts up to min(cuda_graph_max_prefill_tokens, max_num_batched_tokens)
    # (0: no prefill graphs; larger steps run eager), holding at most
    # min(cuda_graph_max_prefill_seqs, max_num_seqs) sequences (more run eager).
    cuda_graph_max_batch: int | None = None
    cuda_graph_max_prefill_tokens: int = 2048
    cuda_graph_max_prefill_seqs: int = 64
    # CPU intra-op threads for this engine (None: torch's default). Several engine processes
    # on one small machine should split the cores: oversubscribed OpenMP threads spin and run
    # ~10x slower than one thread each.
    cpu_threads: int | None = None
    # CPU inter-op threads (None: 1): the engine runs one forward at a time on its own thread,
    # so an inter-op pool only adds idle threads to a small host
    cpu_interop_threads: int | None = None
    # CPU, fp32: matmul weights stored [in, out] contiguous (engine/cpu_layout.py)
    cpu_weight_layout: bool = True
    # CPU, fp32: matmuls of 2+ rows through oneDNN-prepacked weights (engine/cpu_matmul.py).
    # The packed copy doubles the weights' memory: auto = on while they are <= 2 GiB
    cpu_packed_matmul: str = "auto"
    # CPU, fp32: one-row matmuls (a single decode stream) through the BLAS measured fastest
    # per weight shape at load (engine/cpu_gemv.py); "torch": F.linear always
    cpu_one_row_matmul: str = "auto"
    # CPU: the C kernels built here at first use (engine/cpu_native.py): paged attention of decode
    # rows and short prompts, fp32 matmuls of 1-64 rows on AVX-512 (with the packed copies: they
    # replace the one-row choice), add+RMSNorm, SiLU-and-mul, rotary; auto falls back to
    # torch ops without a C compiler, native requires them, torch never builds them
    cpu_kernels: str = "auto"
    # Decode matmuls with at most this many rows run through the fused skinny-GEMM Triton
    # kernels (norm / silu / residual fused); larger batches use cuBLAS. None: the tuned
    # default (engine.kernels.skinny_configs.DEFAULT_MAX_M); 0: off. CUDA only.
    skinny_gemm_max_batch: int | None = None

    def __post_init__(self) -> None:
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        _check(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1")
        _check(self.cpu_interop_threads is None or self.cpu_interop_threads >= 1,
               "cpu_interop_threads must be >= 1")
        _check(self.cpu_one_row_matmul in ("auto", "torch"),
               f"cpu_one_row_matmul must be auto or torch, got {self.cpu_one_row_matmul!r}")
        _check(self.cpu_kernels in ("auto", "native", "torch"),
               f"cpu_kernels must be auto, native or torch, got {self.cpu_kernels!r}")
        _check(self.cpu_packed_matmul in CPU_PACKED_MATMUL,
               f"cpu_packed_matmul must be one of {CPU_PACKED_MATMUL}, got {self.cpu_packed_matmul!r}")
        _check(self.skinny_gemm_max_batch is None or 0 <= self.skinny_gemm_max_batch <= 64,
               f"skinny_gemm_max_batch must be in [0, 64], got {self.skinny_gemm_max_batch}")
        _check(self.cuda_graph_max_batch is None or self.cuda_graph_max_batch >= 1,
               f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        _check(isinstance(self.cuda_graph_max_prefill_tokens, int)
               and self.cuda_graph_max_prefill_tokens >= 0,
               "cuda_graph_max_prefill_tokens must be an integer >= 0 (0 disables prefill graphs),"
               f" got {self.cuda_graph_max_prefill_tokens!r}")
        _check(self.cuda_graph_max_prefill_seqs >= 1,
               f"cuda_graph_max_prefill_seqs must be >= 1, got {self.cuda_graph_max_prefill_seqs}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    # launch choices of the Triton kernels (engine/kernels/options.py); the defaults serve
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        s = self.scheduler
        if not s.enable_chunked_prefill and self.model.max_model_len is not None:
            _check(s.max_num_batched_tokens >= self.model.max_model_len,
                   "without chunked prefill, max_num_batched_tokens must be >= max_model_len")
