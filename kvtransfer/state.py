"""Per-transfer state shared by every backend.

Lifecycle (both sides):  BOOTSTRAPPING -> TRANSFERRING -> DONE
                                      \\-------------\\--> FAILED
BOOTSTRAPPING: receiver: blocks reserved, nothing arrived yet / sender: opened, nothing sent.
TRANSFERRING:  at least one chunk moved.
DONE:          every layer landed (receiver) / the receiver acked the commit (sender).
FAILED:        timeout, dead peer, partial stream, bad data, abort. On the receiver a FAILED
               transfer's reserved blocks are freed through the release callback (exactly once).
Transfers are looked up by transfer id, so they may complete in any order.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.kv_blocks import NAME_DTYPES


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class TransferError(RuntimeError):
    """A KV transfer failed; the message says why (timeout, dead peer, bad chunk, ...)."""


@dataclass(frozen=True)
class KVLayout:
    """Storage layout of a KV cache; sender and receiver must agree exactly.
    Per-layer tensor: [2, n_blocks, block_size, num_kv_heads, head_dim] (K then V)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str          # engine.kv_blocks.DTYPE_NAMES value
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in NAME_DTYPES:
            raise ValueError(f"unknown kv dtype {self.dtype!r}; one of {sorted(NAME_DTYPES)}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) < 1:
            raise ValueError(f"bad KV layout {self}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return NAME_DTYPES[self.dtype]

    def layer_shape(self, n_blocks: int) -> tuple[int, ...]:
        return (2, n_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_nbytes(self, n_blocks: int) -> int:
        n = 1
        for d in self.layer_shape(n_blocks):
            n *= d
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def check_layer(self, shape: tuple[int, ...], dtype: str, max_blocks: int) -> None:
        """Raise TransferError if a layer tensor does not fit this layout / reservation."""
        if dtype != self.dtype:
            raise TransferError(f"kv dtype {dtype!r} does not match the receiver's {self.dtype!r}")
        if len(shape) != 5 or shape[0] != 2 or tuple(shape[2:]) != self.layer_shape(0)[2:]:
            raise TransferError(f"layer shape {tuple(shape)} does not match the receiver's "
                                f"[2, n, {self.block_size}, {self.num_kv_heads}, {self.head_dim}]")
        if not (1 <= shape[1] <= max_blocks):
            raise TransferError(f"{shape[1]} blocks sent but {max_blocks} reserved")


@dataclass
class Transfer:
    """One transfer's record. Mutated only on the event loop that owns the receiver/sender."""
    transfer_id: str
    request_id: str
    state: TransferState = TransferState.BOOTSTRAPPING
    created: float = field(default_factory=time.monotonic)
    deadline: float = float("inf")      # monotonic; past it, a non-terminal transfer FAILs
    error: str | None = None
    layers_done: set[int] = field(default_factory=set)
    bytes_moved: int = 0
    num_blocks: int | None = None       # blocks per layer seen (all layers must agree)
    k_scales: dict[int, float] = field(default_factory=dict)
    v_scales: dict[int, float] = field(default_factory=dict)
    started_at: float | None = None     # first byte moved
    finished_at: float | None = None
    claimed: bool = False               # receiver: the decode request took over the blocks
    block_ids: list[int] | None = None  # receiver: the reserved blocks, when known at expect
    skip_blocks: int = 0                # receiver: leading prompt blocks decode already held
    prompt: tuple = ()                  # receiver: the Reserve's prompt, when it came with one

    @property
    def duration_s(self) -> float:
        """Reservation (or open) until done/failed (or now)."""
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.created

    @property
    def transfer_s(self) -> float:
        """First byte until done/failed (or now): the wire time, without waiting for prefill."""
        if self.started_at is None:
            return 0.0
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started_at


class SendRecords:
    """A sender's records of its recent transfers (for KVSender.get), oldest dropped past
    `keep`: bounded memory however many requests a prefill service serves."""

    def __init__(self, keep: int = 1024):
        self.keep = keep
        self._by_id: dict[str, Transfer] = {}

    def open(self, transfer_id: str, request_id: str, timeout_s: float | None) -> Transfer:
        rec = Transfer(transfer_id, request_id)
        if timeout_s:
            rec.deadline = rec.created + timeout_s
        self._by_id[transfer_id] = rec
        while len(self._by_id) > self.keep:
            self._by_id.pop(next(iter(self._by_id)))
        return rec

    def get(self, transfer_id: str) -> Transfer | None:
        return self._by_id.get(transfer_id)
