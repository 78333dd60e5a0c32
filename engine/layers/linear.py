"""Linear layers whose weights are loaded from several HF tensors (fused at load time).

Parameters are created uninitialised (torch.empty): weights always come from a loader,
and skipping init keeps building an 8B model cheap.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    """y = x @ W^T (+ b). W: [out_features, in_features] like torch / HF."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                         requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)
        # CPU fp32: oneDNN's prepacked copy of weight (engine/cpu_matmul.py), used for inputs of
        # at least packed_min_rows rows (1 where it measured faster at one row: engine/cpu_gemv.py)
        self.packed: torch.Tensor | None = None
        self.packed_min_rows = 2
        # CPU fp32: the weight in the C kernel's tile order and the kernel, for steps of up to
        # cpu_skinny.max_rows rows (engine/layers/cpu_skinny.py); set by the runner
        self.skinny: torch.Tensor | None = None
        self.cpu_skinny = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.shape[0] <= self.cpu_skinny.max_rows:
            y = self.cpu_skinny(x, self.skinny, self.out_features, self.bias)
            if y is not None:
                return y
        if self.packed is not None and x.shape[0] >= self.packed_min_rows:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def row_bucket(n: int) -> int:
    """Rows a packed matmul of n rows runs with: a power of two up to 8, then a multiple of 8 up
    to 128, then of 16 (at most 138 shapes up to 2048 rows, padding under 12% past 8 rows)."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 128 else 16
    return -(-n // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] fp32 -> x @ W^T (+ bias) through oneDNN's packed weight.
    NOTE: rows are padded to row_bucket(n): oneDNN keeps a primitive (and its buffers) per input
    shape, so unbucketed prompt lengths grow the process without bound (~0.8 MiB a request:
    python -m lab.engine_rss); padding rows is cheap where the weights' bytes dominate."""
    n = x.shape[0]
    b = row_bucket(n)
    if b != n:
        x = F.pad(x, (0, 0, 0, b - n))
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y if b == n else y[:n]


class MergedLinear(Linear):
    """Several projections of the same input stacked along out_features, e.g. q|k|v or
    gate|up. `shards` names each part and its size, in order."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(shards.values()), bias, dtype)
        self.shard_sizes = dict(shards)
        self.offsets: dict[str, int] = {}
        off = 0
        for name, size in shards.items():
            self.offsets[name] = off
            off += size

    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        if shard not in self.shard_sizes:
            raise ValueError(f"unknown shard {shard!r}; have {list(self.shard_sizes)}")
        p = getattr(self, param_name)
        if p is None:
            raise ValueError(f"layer has no {param_name} but the checkpoint holds one for {shard}")
        off, size = self.offsets[shard], self.shard_sizes[shard]
        _copy(p.data[off:off + size], tensor, f"{shard}.{param_name}")

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        """y [..., out_features] -> one view per shard, in order."""
        return list(y.split(list(self.shard_sizes.values()), dim=-1))


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
