"""Sharing a KV pool between two processes of one host: the owner serves its pool's handle on
a Unix socket, a peer maps it (engine.kv_memory: memfd on CPU, CUDA VMM on a GPU).

    server = PoolServer(pool, layout_info)   # owner (prefill): address = server.address
    peer = attach(address, device)           # peer (decode): peer.blocks is the owner's pool
    ...                                      # as uint8 [num_layers * 2, num_blocks, block_bytes]
    peer.close()

The socket is in Linux's abstract namespace (no file to clean up) and answers only processes
of the same user (SO_PEERCRED). The owner keeps every accepted connection open: a peer sees
EOF when the owner's process ends, however it ends (`PeerPool.dead`, `on_dead`), and must then
close its mapping (engine.kv_memory's NOTE on mappings that outlive their owner).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import threading
from typing import Callable

import torch

from engine.kv_memory import Pool, PoolMeta, map_pool

log = logging.getLogger("splitserve.kvtransfer.pool")

_MAX_HEADER = 64 * 1024


class PoolUnreachable(RuntimeError):
    """The owner's pool cannot be mapped here (other host or namespace, other user, no driver)."""


class PoolServer:
    """Hands `pool`'s fd and its layout to peers that connect; runs on its own thread."""

    def __init__(self, pool: Pool, info: dict, name: str | None = None):
        self.pool = pool
        meta, self._fd = pool.export()
        self.pool_id = secrets.token_hex(8)
        self.header = json.dumps({"meta": meta.to_dict(), "pool_id": self.pool_id, **info}).encode()
        self.address = name or f"splitserve-kvpool-{os.getpid()}-{self.pool_id}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.address)
        self._sock.listen(16)
        self._conns: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="kv-pool-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                if uid != os.getuid():
                    log.warning("kv pool: refused a peer of uid %d", uid)
                    conn.close()
                    continue
                socket.send_fds(conn, [struct.pack("!I", len(self.header)) + self.header], [self._fd])
                self._conns.append(conn)  # held open: its EOF tells the peer we are gone
            except OSError as e:
                log.warning("kv pool: a peer's handshake failed: %s", e)
                conn.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in self._conns:
            c.close()
        self._conns.clear()


class PeerPool:
    """A peer's mapping of an owner's pool; `blocks` is uint8 [layers * 2, blocks, block_bytes]."""

    def __init__(self, pool: Pool, info: dict, conn: socket.socket):
        self.pool, self.info, self._conn = pool, info, conn
        self.pool_id = info["pool_id"]
        n_layers, n_blocks, block_bytes = info["num_layers"], info["num_blocks"], info["block_bytes"]
        self.blocks = pool.tensor[: n_layers * 2 * n_blocks * block_bytes].view(
            n_layers * 2, n_blocks, block_bytes)
        self.dead = threading.Event()
        self.on_dead: Callable[[], None] | None = None
        self._watch = threading.Thread(target=self._watch_owner, name="kv-pool-watch", daemon=True)
        self._watch.start()

    def _watch_owner(self) -> None:
        try:
            while self._conn.recv(1):
                pass
        except OSError:
            pass
        self.dead.set()
        cb = self.on_dead
        if cb is not None:
            try:
                cb()
            except RuntimeError:  # its event loop is closed: nobody left to tell
                pass

    def close(self) -> None:
        self.on_dead = None  # closing the socket ends the watch: that is no death
        self.blocks = None
        self.pool.close()
        try:
            self._conn.close()
        except OSError:
            pass


def attach(address: str, device: torch.device | str, timeout_s: float = 5.0) -> PeerPool:
    """Map the pool served at `address` (blocking: call off the event loop)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout_s)
    try:
        conn.connect("\0" + address)
        data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_HEADER + 4, 1)
    except OSError as e:
        conn.close()
        raise PoolUnreachable(f"cannot reach KV pool {address!r}: {e}") from e
    try:
        if not fds or len(data) < 4:
            raise PoolUnreachable(f"KV pool {address!r} sent no handle")
        (n,) = struct.unpack("!I", data[:4])
        while len(data) < 4 + n:  # the header may arrive in pieces after the fd
            more = conn.recv(4 + n - len(data))
            if not more:
                raise PoolUnreachable(f"KV pool {address!r} closed during the handshake")
            data += more
        info = json.loads(data[4:4 + n])
        meta = PoolMeta.from_dict(info["meta"])
        fd, extra = fds[0], fds[1:]
        for f in extra:
            os.close(f)
        try:
            pool = map_pool(meta, fd, device)
        except Exception as e:  # noqa: BLE001 - any mapping failure means: not from here
            raise PoolUnreachable(f"cannot map KV pool {address!r} ({meta.kind}) on {device}: {e}") from e
        conn.settimeout(None)
        return PeerPool(pool, info, conn)
    except BaseException:
        conn.close()
        raise
