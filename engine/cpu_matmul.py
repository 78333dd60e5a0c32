"""CPU fp32 matmuls of several rows through oneDNN with prepacked weights.

Each Linear (and the LM head) gets a oneDNN copy of its weight in the blocked layout oneDNN's
GEMM reads (torch.ops.mkldnn._reorder_linear_weight), used for inputs of 2 or more rows:
decode batches and prompts. One-row inputs (a single decode stream) keep F.linear on the
[in, out] weight (engine/cpu_layout.py), which streams it faster at one row. The packed copy
doubles the weights' memory: DeviceConfig.cpu_packed_matmul auto turns it on only for models
whose fp32 weights fit engine.runner.CPU_PACKED_MAX_BYTES.
The packed copies are taken once, after loading: weights changed later are not seen by them.

Results equal F.linear's to fp32 rounding (a different summation order), not bit for bit.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear, packed_linear  # noqa: F401 - re-exported

log = logging.getLogger("splitserve.engine.cpu_matmul")


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(w: torch.Tensor) -> torch.Tensor:
    """[out, in] fp32 weight -> oneDNN's packed copy (a non-contiguous one is copied first)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


def linear_weights_bytes(model) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, Linear)) + model.lm_head_weight.numel() * 4


@torch.no_grad()
def pack_model(model) -> torch.Tensor | None:
    """Gives every fp32 Linear of model its packed copy (Linear.packed); returns the LM head's
    packed copy (None when the head is not fp32)."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.weight.dtype == torch.float32:
            mod.packed = pack(mod.weight)
            n += 1
    head = model.lm_head_weight
    log.info("cpu matmuls: %d linears and the LM head prepacked for oneDNN (inputs of 2+ rows)", n)
    return pack(head) if head.dtype == torch.float32 else None


def logits(hidden: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           min_rows: int = 2) -> torch.Tensor:
    """hidden [N, H] -> fp32 logits [N, vocab]: the packed head for min_rows rows or more (1
    where engine/cpu_gemv.py measured it faster at one row)."""
    if packed is not None and hidden.shape[0] >= min_rows and hidden.dtype == torch.float32:
        return packed_linear(hidden, packed, None)
    return F.linear(hidden.to(weight.dtype), weight).float()
