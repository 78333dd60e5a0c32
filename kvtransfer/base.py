"""Backend-independent interfaces of the transfer module.

Sender side (prefill):
    tx = await sender.open(ticket_address, transfer_id, request_id, layout, num_tokens)
    tx.send_layer(0, layer0)        # as each layer becomes ready (non-blocking, keeps order)
    tx.send_layer(1, layer1, k_scale=.., v_scale=..)
    nbytes = await tx.finish()      # commit; raises TransferError, state DONE | FAILED
Receiver side (decode): see kvtransfer.receiver.KVReceiver, which a backend's server feeds.
"""
from __future__ import annotations

import abc

import torch

from kvtransfer.state import KVLayout, Transfer, TransferState


class SendTransfer(abc.ABC):
    """One outgoing transfer."""

    record: Transfer

    @property
    def state(self) -> TransferState:
        return self.record.state

    @abc.abstractmethod
    def send_layer(self, layer_idx: int, tensor: torch.Tensor, k_scale: float | None = None,
                   v_scale: float | None = None) -> None:
        """Queue one layer [2, n_blocks, block_size, kv_heads, head_dim] (CPU, not mutated after)."""

    @abc.abstractmethod
    async def finish(self) -> int:
        """Commit after the last layer; wait for the receiver's ack. -> bytes sent."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None:
        """Stop sending; the receiver sees a partial stream and frees its blocks."""


class KVSender(abc.ABC):
    backend = "base"  # name in logs, metrics and PrefillResponse.kv_backend

    @abc.abstractmethod
    async def open(self, address: str, transfer_id: str, request_id: str, layout: KVLayout,
                   num_tokens: int, timeout_s: float | None = None,
                   metadata: tuple | None = None, *, peer=None) -> SendTransfer:
        """metadata: transport headers (e.g. W3C traceparent) for backends that carry them.
        peer: the decode's kvtransfer.endpoint.PairEndpoint (from the ticket), for backends
        that pair with it directly (dist, nixl); others ignore it."""

    @abc.abstractmethod
    def get(self, transfer_id: str) -> Transfer | None:
        """State of a (recent) outgoing transfer."""

    def unusable(self, address: str) -> str | None:
        """Why this backend should not be tried with `address` now (None: go ahead)."""
        return None

    def prepare(self, address: str, peer) -> None:  # noqa: B027 - optional
        """Start whatever a first transfer to `address` needs (e.g. pairing) in the background."""

    async def close(self) -> None:  # noqa: B027 - optional
        pass


async def send_blocks(sender: KVSender, address: str, transfer_id: str, request_id: str,
                      blocks, layout: KVLayout, timeout_s: float | None = None,
                      metadata: tuple | None = None, peer=None) -> int:
    """Send a whole engine KVBlocks layer by layer; -> bytes sent (raises TransferError)."""
    tx = await sender.open(address, transfer_id, request_id, layout, blocks.num_tokens, timeout_s,
                           metadata, peer=peer)
    try:
        for i, t in enumerate(blocks.layers):
            ks = blocks.k_scales[i] if blocks.k_scales is not None else None
            vs = blocks.v_scales[i] if blocks.v_scales is not None else None
            tx.send_layer(i, t, ks, vs)
        return await tx.finish()
    except BaseException:
        await tx.abort("sender failed")
        raise
