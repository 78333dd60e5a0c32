"""Layer-by-layer KV export for prefill-only requests (disaggregation): layer i of a request's
blocks is handed out as soon as the forward pass finished writing it, while later layers
still compute, so the transfer overlaps the rest of the prompt.

    eng.stream_kv_layers(rid, on_layer)          # before add_request(rid, ..., prefill_only=True)
    # during the step that completes rid's prompt: on_layer(LayerExport(rid, i, ...)) for
    # i = 0 .. num_layers-1, on the engine thread, in layer order

The model calls `hook(i)` after layer i (CausalLM.layer_hook). For each streamed request whose
prompt ends in this step, the hook gathers that layer's blocks into a fresh tensor, on the
compute stream right behind the layer's KV writes, and records a CUDA event after it.

Hazards:
- NOTE: only the step that completes the prompt exports: with chunked prefill, earlier chunks
  leave layer i incomplete. That step's hook sees every earlier chunk's blocks already written.
- NOTE: a forward that bypasses the hook (a CUDA-graph replay of a one-token step) still
  exports: `end_step` emits every layer the hook did not, after the forward.
- NOTE: on CUDA, consumers must `wait()` (or order after `event`) before reading `tensor`, and
  never read it on the engine's stream from another thread (that stream is busy with later
  layers); `host()` copies on a side stream. fp8 scales are copied to pinned host memory
  behind the same event, so reading them never syncs the compute stream.
- NOTE: `on_layer` runs on the engine thread inside the forward: it must only hand the export
  over (e.g. loop.call_soon_threadsafe), never block.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LayerExport:
    request_id: str
    layer_idx: int
    num_layers: int
    num_tokens: int
    tensor: torch.Tensor                  # [2, n_blocks, block_size, kv_heads, head_dim], storage dtype
    scales: torch.Tensor | None = None    # fp8: host float32 [k_scale, v_scale], valid after wait()
    event: object | None = None           # torch.cuda.Event recorded after the gather (CUDA only)

    def wait(self) -> None:
        """Block until the layer's data is complete (no-op on CPU)."""
        if self.event is not None:
            self.event.synchronize()

    @property
    def k_scale(self) -> float | None:
        return None if self.scales is None else float(self.scales[0])

    @property
    def v_scale(self) -> float | None:
        return None if self.scales is None else float(self.scales[1])

    def host(self) -> torch.Tensor:
        """The layer on the CPU (blocking: call off the event loop)."""
        self.wait()
        if self.tensor.device.type == "cpu":
            return self.tensor
        with torch.cuda.stream(_side_stream(self.tensor.device)):  # see NOTE on streams
            return self.tensor.to("cpu")


_tls = threading.local()


def _side_stream(device: torch.device):
    s = getattr(_tls, "stream", None)
    if s is None or s.device != device:
        s = _tls.stream = torch.cuda.Stream(device)
    return s


@dataclass
class _Row:
    request_id: str
    idx: torch.Tensor          # block ids on the device
    num_tokens: int
    on_layer: Callable[[LayerExport], None]
    emitted: int = 0           # layers handed out so far (in order)


class LayerStreamer:
    """Owns the per-request registrations; the engine drives it around each forward."""

    def __init__(self, kv_caches: list[torch.Tensor], kv_scales, device: torch.device):
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales
        self.device = torch.device(device)
        self.callbacks: dict[str, Callable[[LayerExport], None]] = {}
        self.skip: dict[str, int] = {}  # leading blocks not exported (the receiver holds them)
        self._rows: list[_Row] = []

    def register(self, request_id: str, on_layer: Callable[[LayerExport], None],
                 skip_blocks: int = 0) -> None:
        if skip_blocks < 0:
            raise ValueError(f"skip_blocks must be >= 0, got {skip_blocks}")
        self.callbacks[request_id] = on_layer
        self.skip[request_id] = skip_blocks

    def unregister(self, request_id: str) -> None:
        self.callbacks.pop(request_id, None)
        self.skip.pop(request_id, None)

    def begin_step(self, rows: list[tuple[str, list[int], int]]) -> Callable[[int], None] | None:
        """rows: (request id, block ids, prompt tokens) of streamed requests whose prompt ends
        in this step. -> the hook for the model, or None when there is nothing to export."""
        self._rows = []
        for rid, block_ids, n_tokens in rows:
            cb = self.callbacks.get(rid)
            if cb is None:
                continue
            n_blocks = -(-n_tokens // self.kv_caches[0].shape[2])
            skip = min(self.skip.get(rid, 0), n_blocks - 1)  # NOTE: at least one block goes
            idx = torch.tensor(block_ids[skip:n_blocks], dtype=torch.long, device=self.device)
            self._rows.append(_Row(rid, idx, n_tokens, cb))
        return self.hook if self._rows else None

    def hook(self, layer_idx: int) -> None:
        for row in self._rows:
            if row.emitted == layer_idx:
                self._emit(row, layer_idx)

    def end_step(self) -> None:
        """After the forward: export whatever the hook did not see, then forget the rows."""
        for row in self._rows:
            for i in range(row.emitted, len(self.kv_caches)):
                self._emit(row, i)
            self.unregister(row.request_id)  # one prompt, one export
        self._rows = []

    def _emit(self, row: _Row, i: int) -> None:
        cache = self.kv_caches[i]
        # NOTE: index ops lack fp8 kernels on CPU; gather raw bytes and view back
        t = cache.view(torch.uint8).index_select(1, row.idx).view(cache.dtype)
        scales = ev = None
        if self.kv_scales is not None:
            src = torch.stack([self.kv_scales.k[i], self.kv_scales.v[i]])
            if src.is_cuda:
                scales = torch.empty(2, dtype=torch.float32, pin_memory=True)
                scales.copy_(src, non_blocking=True)
            else:
                scales = src.clone()
        if cache.is_cuda:
            ev = torch.cuda.Event()
            ev.record()  # on the current (compute) stream, right behind the gather
        row.emitted = i + 1
        row.on_layer(LayerExport(row.request_id, i, len(self.kv_caches), row.num_tokens, t, scales, ev))
