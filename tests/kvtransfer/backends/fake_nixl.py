"""A fake nixl agent for the nixl backend's tests: the slice of nixl._api.nixl_agent that
kvtransfer/backends/nixl.py calls, with READs done by memmove between registered ranges."""
from __future__ import annotations

import asyncio
import ctypes


class FakeAgent:
    """The slice of nixl_agent the adapter uses. READ copies remote -> local with memmove after
    checking both ranges lie in memory registered with the right agent."""

    agents: dict[str, "FakeAgent"] = {}

    def __init__(self, name: str, hold: asyncio.Event | None = None):
        self.name = name
        self.regions: list[tuple[int, int]] = []
        self.peers: set[str] = set()
        self.reads: list[int] = []       # descriptors per READ
        self.released = 0
        self.hold = hold                 # READs stay "PROC" until this is set
        self.notifs: dict[str, list[bytes]] = {}  # from peers' finished READs, until fetched
        self.notified = 0                # READs of ours that carried a notification
        FakeAgent.agents[name] = self

    def get_agent_metadata(self) -> bytes:
        return f"fake:{self.name}".encode()

    def add_remote_agent(self, md: bytes) -> str:
        name = md.decode().split(":", 1)[1]
        self.peers.add(name)
        return name

    def remove_remote_agent(self, name):
        self.peers.discard(name)

    def register_memory(self, tensors):
        for t in tensors:
            self.regions.append((t.data_ptr(), t.numel() * t.element_size()))
        return ("reg", len(tensors))

    def get_xfer_descs(self, descs, mem_type):
        assert mem_type in ("DRAM", "VRAM")
        return list(descs)

    def initialize_xfer(self, op, local, remote, peer, notif):
        assert op == "READ" and peer in self.peers, (op, peer)
        assert len(local) == len(remote)
        return {"local": local, "remote": remote, "peer": peer, "done": False, "notif": notif}

    def transfer(self, h):
        return "PROC"

    def check_xfer_state(self, h):
        if self.hold is not None and not self.hold.is_set():
            return "PROC"
        if not h["done"]:
            remote = FakeAgent.agents[h["peer"]]
            for (la, ln, _), (ra, rn, _) in zip(h["local"], h["remote"]):
                if not (self._registered(la, ln) and remote._registered(ra, rn)):
                    return "ERR"
                ctypes.memmove(la, ra, ln)
            h["done"] = True
            self.reads.append(len(h["local"]))
            if h["notif"]:
                self.notified += 1
                remote.notifs.setdefault(self.name, []).append(bytes(h["notif"]))
        return "DONE"

    def get_new_notifs(self):
        out, self.notifs = self.notifs, {}
        return out

    def release_xfer_handle(self, h):
        self.released += 1

    def _registered(self, addr, n):
        return any(a <= addr and addr + n <= a + ln for a, ln in self.regions)
