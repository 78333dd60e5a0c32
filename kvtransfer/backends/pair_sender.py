"""PairKVSender: the KVSender of the direct backends (dist, nixl): one PairClient per decode
address, connected on first use (or early, through `prepare`), shared by every transfer to it.

    sender = DistKVSender(local)                       # a PairKVSender subclass
    tx = await sender.open(addr, tid, rid, layout, n, timeout_s, peer=endpoint)
    tx.send_layer(i, tensor, ks, vs); ...; nbytes = await tx.finish()

A pair that fails to connect raises PairUnavailable and is not retried for `retry_after_s`
(`unusable(address)` says why, so callers fall back to grpc without waiting on it again).
"""
from __future__ import annotations

import abc
import asyncio
import time

import grpc

from common.grpc_util import channel_options, open_channel
from kvtransfer.backends.pair_client import PairClient, PairSendTransfer, PairUnavailable, _retrieve
from kvtransfer.base import KVSender
from kvtransfer.endpoint import PairEndpoint
from kvtransfer.state import SendRecords, Transfer, TransferError


class PairKVSender(KVSender):
    """KVSender over PairClients: one per decode address, connected on first use."""

    backend = "pair"

    def __init__(self, local: PairEndpoint, *, op_timeout_s: float = 30.0,
                 connect_timeout_s: float = 30.0, retry_after_s: float = 10.0,
                 keep_records: int = 1024, auth=None):
        self.local = local
        self.auth = auth  # common.auth.InternalAuth: credentials of the channel; dist store keys
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._pairs: dict[str, PairClient] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._failed: dict[str, tuple[float, str]] = {}  # address -> (retry at, reason)
        self._records = SendRecords(keep_records)
        self.num_pairs_made = 0

    @abc.abstractmethod
    def make_pair(self, channel, address: str, peer: PairEndpoint) -> PairClient: ...

    def unusable(self, address: str) -> str | None:
        """Why a pair with `address` is not tried now (a recent handshake failure), or None."""
        f = self._failed.get(address)
        if f is None:
            return None
        if time.monotonic() >= f[0]:
            self._failed.pop(address, None)
            return None
        return f[1]

    def prepare(self, address: str, peer: PairEndpoint) -> None:
        """Start connecting in the background (e.g. while the prompt runs)."""
        if address not in self._pairs and self.unusable(address) is None:
            self._connect_task(address, peer)

    def _connect_task(self, address: str, peer: PairEndpoint) -> asyncio.Task:
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(address, peer))
            task.add_done_callback(_retrieve)
            self._connecting[address] = task
        return task

    async def _connect(self, address: str, peer: PairEndpoint) -> PairClient:
        try:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = open_channel(address, self.auth, channel_options())
            pair = self.make_pair(ch, address, peer)
            await pair.connect()
        except PairUnavailable as e:
            self._failed[address] = (time.monotonic() + self.retry_after_s, str(e))
            raise
        finally:
            self._connecting.pop(address, None)
        pair.on_gone = self._gone
        self._pairs[address] = pair
        self.num_pairs_made += 1
        return pair

    def _gone(self, pair: PairClient) -> None:
        if self._pairs.get(pair.address) is pair:
            self._pairs.pop(pair.address, None)

    async def open(self, address, transfer_id, request_id, layout, num_tokens, timeout_s=None,
                   metadata=None, *, peer: PairEndpoint | None = None) -> PairSendTransfer:
        if not address:
            raise TransferError("no decode address in the transfer ticket")
        pair = self._pairs.get(address)
        if pair is not None and peer is not None and pair.peer != peer:
            pair.fail("decode's pair endpoint changed (restarted?)")  # drops it from _pairs
            pair = None
        if pair is None:
            why = self.unusable(address)
            if why is not None:
                raise PairUnavailable(why)
            if peer is None:
                raise PairUnavailable(f"no pair endpoint for {address} (decode did not offer {self.backend})")
            pair = await asyncio.shield(self._connect_task(address, peer))
        rec = self._records.open(transfer_id, request_id, timeout_s)
        return pair.open(rec, layout, num_tokens)

    def get(self, transfer_id: str) -> Transfer | None:
        return self._records.get(transfer_id)

    async def close(self) -> None:
        for t in list(self._connecting.values()):
            t.cancel()
        for p in list(self._pairs.values()):
            await p.close()
        self._pairs.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
