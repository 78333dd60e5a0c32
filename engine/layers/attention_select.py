"""Attention backend selection by config name (kept apart from engine/layers/attention.py,
whose base classes the backends import)."""
from __future__ import annotations

from engine.kernels.options import DEFAULT_KERNELS, KernelOptions
from engine.layers.attention import AttentionBackend, TorchAttentionBackend


def get_attention_backend(name: str, device: str, num_heads: int, num_kv_heads: int,
                          head_dim: int, kernels: KernelOptions = DEFAULT_KERNELS,
                          cpu_kernels: str = "torch") -> AttentionBackend:
    """Pick a backend by config name. 'auto': triton on cuda, torch on cpu; flash_attn (FA4) runs
    only when named: it measured within a few % of triton and JIT-compiles each new shape on
    first use (`python -m bench.attention_backends_gpu` compares them). Backends
    register lazily so CPU installs need neither. kernels: the engine's KernelOptions (the
    model's set_kernels hands them on as well). cpu_kernels (torch backend on CPU): auto / native
    run the decode rows through the C kernel (engine/layers/attention_cpu_native.py; auto falls
    back to torch ops where it cannot be built), torch keeps torch ops."""
    if name == "auto":
        name = "torch" if device == "cpu" else "triton"
    if name == "torch":
        cpu_decode = None
        if device == "cpu":
            from engine.layers.attention_cpu_native import make

            cpu_decode = make(cpu_kernels)
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, kernels=kernels,
                                     cpu_decode=cpu_decode)
    if name == "triton":
        from engine.layers.attention_triton import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, kernels=kernels)
    if name == "flash_attn":
        from engine.layers.attention_flash import FlashAttentionBackend

        return FlashAttentionBackend(num_heads, num_kv_heads, head_dim, kernels=kernels)
    raise ValueError(f"unknown attention backend {name!r}")
