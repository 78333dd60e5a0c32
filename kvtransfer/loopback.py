"""A KV receiver in its own process, for tests and benchmarks: a paged cache in memory behind
the decode-side endpoints (KVTransfer gRPC: PushKV + PairSession, and a dist rendezvous store),
driven from the parent through a pipe.

    rp = ReceiverProc.spawn(layout, num_blocks=64)        # child process (spawn), ready
    rp.expect("t1", "r1", block_ids=[7, 2], num_tokens=20)  # what decode.Reserve does
    ... send to rp.address with any sender (dist: peer=rp.endpoint) ...
    state, error = rp.wait("t1", 5)
    raw = rp.read("r1", layer=0, num_blocks=2)           # uint8 bytes of those blocks
    rp.kill()  /  rp.stop()

Not used by the services; it lives in the package, not under tests/, because
bench/kv_transfer.py drives it too.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from dataclasses import asdict

import torch

from engine.kv_blocks import raw_view
from kvtransfer.endpoint import PairEndpoint
from kvtransfer.state import KVLayout


class MemorySink:
    """A per-layer paged cache; writes land in the request's block ids."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str = "cpu"):
        self.cache = [torch.zeros(layout.layer_shape(num_blocks), dtype=layout.torch_dtype, device=device)
                      for _ in range(layout.num_layers)]
        self.block_ids: dict[str, list[int]] = {}
        self.scales: dict[str, tuple[list[float], list[float]]] = {}
        self.released: list[str] = []

    async def write_layer(self, request_id, layer_idx, tensor, num_tokens):
        await asyncio.sleep(0)  # like AsyncEngine.call: a real suspension point
        dst = self.cache[layer_idx]
        ids = torch.tensor(self.block_ids[request_id][:tensor.shape[1]], device=dst.device)
        raw_view(dst).index_copy_(1, ids, raw_view(tensor.to(dst.device)))  # as engine.import_kv

    async def write_scales(self, request_id, k_scales, v_scales):
        self.scales[request_id] = (list(k_scales), list(v_scales))

    async def release(self, request_id, transfer_id):
        self.released.append(request_id)

    def read(self, request_id: str, layer: int, num_blocks: int) -> bytes:
        src = self.cache[layer]
        ids = torch.tensor(self.block_ids[request_id][:num_blocks], device=src.device)
        return src.view(torch.uint8).index_select(1, ids).cpu().contiguous().numpy().tobytes()


class ReceiverProc:
    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.address = ""
        self.endpoint = PairEndpoint()

    @classmethod
    def spawn(cls, layout: KVLayout, num_blocks: int = 64, device: str = "cpu",
              host: str = "127.0.0.1", timeout_s: float = 30.0, reservation_timeout_s: float = 30.0,
              wait: bool = True, nixl: bool = False) -> "ReceiverProc":
        """Start the child; wait=False returns at once (call wait_ready() later), so several
        can boot in parallel. nixl: also accept nixl pairs (a real agent, the cache registered)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child_main, args=(child, asdict(layout), num_blocks, device, host,
                                                  timeout_s, reservation_timeout_s, nixl), daemon=True)
        p.start()
        rp = cls(p, parent)
        return rp.wait_ready() if wait else rp

    def wait_ready(self, timeout_s: float = 60.0) -> "ReceiverProc":
        if self.address:
            return self
        if not self.conn.poll(timeout_s):
            self.proc.kill()
            raise TimeoutError(f"receiver process not ready in {timeout_s}s")
        kind, address, ep = self.conn.recv()
        if kind != "ready":
            self.proc.join(5)
            raise RuntimeError(f"receiver process failed: {address}")
        self.address, self.endpoint = address, PairEndpoint(**ep)
        return self

    def _call(self, *cmd, timeout_s: float = 30.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"receiver process did not answer {cmd[0]!r}")
        ok, res = self.conn.recv()
        if not ok:
            raise RuntimeError(res)
        return res

    def expect(self, transfer_id, request_id, block_ids, num_tokens, timeout_s=None) -> None:
        self._call("expect", transfer_id, request_id, list(block_ids), num_tokens, timeout_s)

    def wait(self, transfer_id, timeout_s: float = 10.0) -> tuple[str, str | None]:
        return self._call("wait", transfer_id, timeout_s, timeout_s=timeout_s + 10)

    def read(self, request_id, layer, num_blocks) -> bytes:
        return self._call("read", request_id, layer, num_blocks)

    def scales(self, request_id):
        return self._call("scales", request_id)

    def released(self) -> list[str]:
        return self._call("released")

    def claim(self, transfer_id) -> None:
        self._call("claim", transfer_id)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, 9)
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._call("stop", timeout_s=10)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def _child_main(conn, layout_kw, num_blocks, device, host, timeout_s, reservation_timeout_s, nixl=False):
    torch.set_num_threads(1)
    try:
        asyncio.run(_serve(conn, KVLayout(**layout_kw), num_blocks, device, host, timeout_s,
                           reservation_timeout_s, nixl))
    except Exception as e:  # noqa: BLE001 - tell the parent why
        try:
            conn.send(("error", repr(e), {}))
        except OSError:
            pass


async def _serve(conn, layout, num_blocks, device, host, timeout_s, reservation_timeout_s, nixl=False):
    from common.grpc_util import create_server
    from kvtransfer.backends.dist import DistPlane, DistRendezvous
    from kvtransfer.backends.pair_service import KVTransferService
    from kvtransfer.endpoint import local_endpoint
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.state import TransferError
    from protos import kvtransfer_pb2_grpc

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    sink = MemorySink(layout, num_blocks, device)
    planes = {}
    if nixl:  # as decode_svc: READs land in reserved blocks, so the sink waits for them on release
        from kvtransfer.backends.nixl import NixlPlane, make_agent, register_kv_caches
        from kvtransfer.guard import GuardedSink, InflightGuard

        guard, agent = InflightGuard(), make_agent(f"loopback-{os.getpid()}")
        register_kv_caches(agent, sink.cache)

        async def block_ids_of(rid):
            return sink.block_ids[rid]

        planes["nixl"] = lambda: NixlPlane(agent, sink.cache, layout, block_ids_of, guard, timeout_s)
    rx = KVReceiver(GuardedSink(sink, guard) if nixl else sink, layout,
                    default_timeout_s=reservation_timeout_s, reap_interval_s=0.05)
    rdv = DistRendezvous(host, timeout_s=timeout_s)
    local = local_endpoint(device, rdv.address)

    def plane():
        return DistPlane(rdv, local, host, timeout_s)

    svc = KVTransferService(rx, {"gloo": plane, "nccl": plane, **planes},
                            max_layer_bytes=layout.layer_nbytes(num_blocks))
    server = create_server()
    kvtransfer_pb2_grpc.add_KVTransferServicer_to_server(svc, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    conn.send(("ready", f"{host}:{port}", asdict(local)))
    loop = asyncio.get_running_loop()
    try:
        while True:
            cmd = await loop.run_in_executor(None, conn.recv)
            op, args = cmd[0], cmd[1:]
            try:
                if op == "stop":
                    conn.send((True, None))
                    return
                if op == "expect":
                    tid, rid, ids, n, tmo = args
                    sink.block_ids[rid] = ids
                    rx.expect(tid, rid, len(ids), n, tmo)
                    res = None
                elif op == "wait":
                    tid, tmo = args
                    try:
                        t = await rx.wait(tid, tmo)
                        res = (t.state.value, t.error)
                    except TransferError as e:
                        res = ("failed", str(e))
                    except (asyncio.TimeoutError, TimeoutError):
                        t = rx.get(tid)
                        res = (t.state.value if t else "unknown", "still waiting")
                elif op == "read":
                    res = sink.read(*args)
                elif op == "scales":
                    res = sink.scales.get(args[0])
                elif op == "released":
                    res = list(sink.released)
                elif op == "claim":
                    rx.claim(args[0])
                    res = None
                else:
                    raise ValueError(f"unknown command {op!r}")
                conn.send((True, res))
            except Exception as e:  # noqa: BLE001 - reported to the parent
                conn.send((False, f"{type(e).__name__}: {e}"))
    finally:
        await svc.close()
        await rx.close()
        await server.stop(0)
        rdv.close()  # NOTE: after svc.close(), which waited for the pair groups to go
