"""CPU weight layout: fp32 matmul weights stored [in, out] contiguous.

Each Linear's weight (and the LM head) keeps its [out, in] shape as a transposed view of an
[in, out] contiguous tensor, so F.linear(x, W) = x @ W^T hands sgemm a plain row-major right
operand. On x86 CPUs that GEMM streams the weights faster at the small row counts decode runs
(1-32 rows), and decode on CPU is bound by streaming the weights.

A tied LM head (the embedding matrix) gets its own [in, out] copy: the embedding lookup keeps
reading rows of the [vocab, hidden] original.
"""
from __future__ import annotations

import torch

from engine.layers.linear import Linear


def _as_in_out(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()


@torch.no_grad()
def transpose_linear_weights(model) -> int:
    """Rewrites model's fp32 Linear weights and LM head in place; returns how many."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.weight.dtype == torch.float32 and mod.weight.is_contiguous():
            mod.weight.data = _as_in_out(mod.weight.data)
            n += 1
    head = model.lm_head_weight
    if head.dtype == torch.float32 and head.is_contiguous():
        if model.lm_head is None:  # tied: the embedding keeps its layout
            model.lm_head = torch.nn.Parameter(_as_in_out(head), requires_grad=False)
        else:
            model.lm_head.data = _as_in_out(model.lm_head.data)
        n += 1
    return n
