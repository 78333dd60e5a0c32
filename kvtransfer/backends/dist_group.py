"""PairGroup: one torch.distributed process group of two ranks (prefill = rank 0, decode =
rank 1) and the one thread that runs its point-to-point ops.

The group is built directly from a store (a `PrefixStore` on decode's TCPStore, keyed by the
pair id agreed at handshake), not through `init_process_group`: a process has one default
group, but a prefill may pair with many decodes and a decode with many prefills. Ops are the
group's own `send` / `recv` (what `dist.isend` / `dist.irecv` wrap).

    g = PairGroup.create("10.0.0.2:29600", pair_id, rank=0, backend="gloo", device="cpu")
    fut = g.submit_send(tensor_u8, timeout_s=30)     # concurrent.futures.Future[int]
    fut = g.submit_recv(nbytes, timeout_s=30)        # -> Future[uint8 tensor]
    g.close()

Hazards:
- NOTE: gloo and NCCL match point-to-point ops between two ranks in issue order (NCCL has no
  tags at all), so concurrent transfers on one pair must never interleave their ops
  differently on the two sides. Every op goes through one FIFO thread per side, and the
  control stream gives both sides the same order (see kvtransfer.proto, PairSession).
- NOTE: a gloo `wait()` without a timeout and an NCCL recv whose peer died block forever, and
  `abort()` does not wake a blocked gloo wait. Every wait here has a finite timeout (gloo:
  `wait(timeout)`; NCCL: polling `is_completed()`), and the async side watches each op with
  its own deadline on top. The first failed op breaks the group for good: queued ops fail,
  the communicator is aborted, `on_broken` fires once, and the owner builds a new group under
  a new pair id. (gloo closes the pair on a timed-out wait anyway.)
- NOTE: NCCL with the default TORCH_NCCL_ASYNC_ERROR_HANDLING tears the whole process down
  when its own watchdog sees a timed-out op; a server must survive a dead peer, so NCCL
  groups here use CleanUpOnly (2) unless the variable is set, and our timeout fires first.
- NOTE: NCCL ops run on this thread's own CUDA stream after waiting for the layer's event, so
  a send never waits for work queued on the engine's stream after that layer (later layers).
  Received CUDA buffers come from that stream: their consumer must `record_stream` the stream
  it reads them on before dropping them (kvtransfer.backends.pair_service does).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvtransfer.state import TransferError

log = logging.getLogger("splitserve.kvtransfer.dist")

_STOP = object()


@dataclass
class _Op:
    kind: str                      # "send" | "recv"
    tensor: object                 # send: flat uint8 payload; recv: buffer, allocator or None
    nbytes: int
    timeout_s: float
    ready: object | None           # send: torch.cuda.Event the payload waits for (CUDA only)
    fut: concurrent.futures.Future


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r} (want host:port)")
    return host.strip("[]"), int(port)


class PairGroup:
    WINDOW = 4      # ops in flight on the thread
    GRACE_S = 5.0   # watchdog: how far past its own timeout a blocking call may hang

    def __init__(self, pg, rank: int, backend: str, device: str, name: str,
                 on_broken: Callable[[str], None] | None = None):
        self.pg = pg
        self.rank = rank
        self.peer = 1 - rank
        self.backend = backend     # "gloo" | "nccl"
        self.device = torch.device(device)
        self.name = name
        self.on_broken = on_broken
        self.broken: str | None = None
        self.ops_done = 0
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._inflight: collections.deque = collections.deque()  # (op, work, result), issue order
        self._busy: tuple | None = None  # (since, timeout, what, op) of the blocking call now
        self._stream = None  # CUDA: this thread's stream (see NOTE on streams)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-pair-{name[:8]}", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name=f"kv-pair-watch-{name[:8]}", daemon=True).start()

    # ---- setup ----------------------------------------------------------------------
    @classmethod
    def create(cls, store_address: str, pair_id: str, rank: int, backend: str, device: str,
               host: str = "", timeout_s: float = 30.0,
               on_broken: Callable[[str], None] | None = None,
               store_key: str | None = None) -> "PairGroup":
        """Blocking (run it off the event loop): connects to the store, then waits until the
        peer rank joins or `timeout_s` passes (raises TransferError). store_key: the pair's key
        prefix on the store (default pair_id; keyed by the internal secret, see dist.py)."""
        import torch.distributed as dist

        if not dist.is_available():
            raise TransferError("torch.distributed is not available in this torch build")
        shost, sport = split_host_port(store_address)
        td = datetime.timedelta(seconds=timeout_s)
        t0 = time.monotonic()
        try:
            store = dist.TCPStore(shost, sport, None, False, td)
            pstore = dist.PrefixStore(f"splitserve/pair/{store_key or pair_id}/", store)
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = td
                # NOTE: gloo listens on this address and publishes it through the store; it
                # must be one the peer can reach (the service's bind host, not a wildcard).
                dev = (dist.ProcessGroupGloo.create_device(hostname=host) if host
                       else dist.ProcessGroupGloo.create_default_device())
                opts._devices = [dev]
                pg = dist.ProcessGroupGloo(pstore, rank, 2, opts)
            elif backend == "nccl":
                if not dist.is_nccl_available():
                    raise TransferError("this torch build has no NCCL")
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # see NOTE above
                torch.cuda.set_device(torch.device(device))
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = td * 2  # ours (per op) fires first and aborts cleanly
                pg = dist.ProcessGroupNCCL(pstore, rank, 2, opts)
            else:
                raise TransferError(f"unknown pair backend {backend!r}")
        except TransferError:
            raise
        except Exception as e:  # noqa: BLE001 - store unreachable, peer never came, ...
            raise TransferError(f"pair group setup ({backend}, rank {rank}, store {store_address}) "
                                f"failed after {time.monotonic() - t0:.1f}s: {e}") from e
        log.info("kv pair %s: %s group up as rank %d on %s (%.2fs)", pair_id[:8], backend, rank,
                 device, time.monotonic() - t0)
        return cls(pg, rank, backend, device, pair_id, on_broken)

    # ---- ops ------------------------------------------------------------------------
    def submit_send(self, payload: torch.Tensor, timeout_s: float, ready=None) -> concurrent.futures.Future:
        """payload: flat uint8 on this group's device, not mutated until the future is done."""
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError("payload must be a flat uint8 tensor (send other dtypes as bytes)")
        return self._submit(_Op("send", payload, payload.numel(), timeout_s, ready,
                                concurrent.futures.Future()))

    def submit_recv(self, nbytes: int, timeout_s: float,
                    out: torch.Tensor | Callable[[int], torch.Tensor] | None = None
                    ) -> concurrent.futures.Future:
        """-> Future[flat uint8 tensor of nbytes]: a view of `out` when a buffer is given (not
        to be read or reused until the future is done), else a new one. `out` may be a
        callable(nbytes) -> buffer, called on this group's thread when the recv is issued:
        NOTE: buffers are then only held for the ops in flight, not for every announced layer."""
        if isinstance(out, torch.Tensor):
            _check_buffer(out, nbytes, self.device)
        return self._submit(_Op("recv", out, nbytes, timeout_s, None, concurrent.futures.Future()))

    def _submit(self, op: _Op) -> concurrent.futures.Future:
        with self._lock:  # NOTE: checking `broken` and queueing is one step (see _break)
            if self.broken is not None:
                op.fut.set_exception(TransferError(f"kv pair is broken: {self.broken}"))
            else:
                self._q.put(op)
        return op.fut

    def close(self, reason: str = "closed", orderly: bool = True) -> None:
        """Tear the group down and stop the thread; queued ops fail. orderly=False: the pair
        failed (communicator aborted, on_broken fires if it has not yet)."""
        self._break(reason, orderly=orderly)
        self._q.put(_STOP)

    def join(self, timeout_s: float = 10.0) -> bool:
        """Wait for the thread to end after close(); -> True if it did. NOTE: destroy the
        rendezvous TCPStore only after its groups are gone: a store server destroyed while a
        group that used it is being torn down aborts the process (std::terminate)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- the thread -----------------------------------------------------------------
    def _run(self) -> None:
        """Issue ops in queue order, up to WINDOW in flight (the bytes of layer i+1 move while
        layer i's completion is noticed), and complete them in the same order."""
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NOTE: per thread; the engine's does not count
                self._stream = torch.cuda.Stream(self.device)
            while True:
                if self._inflight and (len(self._inflight) >= self.WINDOW or self._q.empty()):
                    self._complete()
                    continue
                op = self._q.get()
                if op is _STOP:
                    while self._inflight:
                        self._complete()
                    return
                if self.broken is not None:
                    _settle(op.fut, exc=TransferError(f"kv pair is broken: {self.broken}"))
                    continue
                try:
                    self._busy = (time.monotonic(), op.timeout_s, f"issuing a {op.kind}", op)
                    work, res = self._issue(op)
                except Exception as e:  # noqa: BLE001 - the group is unusable
                    self._fail_all(op, f"{op.kind} of {op.nbytes} B failed: {e}")
                    continue
                finally:
                    self._busy = None
                with self._lock:
                    self._inflight.append((op, work, res))
        finally:
            self.pg = None  # NOTE: the group is destroyed here, not at interpreter exit
            self._done.set()

    def _on_stream(self):
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def _issue(self, op: _Op):
        with self._on_stream():
            if op.ready is not None and self._stream is not None:
                self._stream.wait_event(op.ready)
            if op.kind == "send":
                return self.pg.send([op.tensor], self.peer, 0), op.nbytes
            out = op.tensor(op.nbytes) if callable(op.tensor) else op.tensor
            if out is not None:
                _check_buffer(out, op.nbytes, self.device)
                buf = out.reshape(-1)[:op.nbytes]
            else:
                buf = torch.empty(op.nbytes, dtype=torch.uint8, device=self.device)
            return self.pg.recv([buf], self.peer, 0), buf

    def _complete(self) -> None:
        with self._lock:
            if not self._inflight:
                return  # the watchdog failed them meanwhile
            op, work, res = self._inflight.popleft()
        try:
            self._busy = (time.monotonic(), op.timeout_s, f"waiting for a {op.kind} of {op.nbytes} B", op)
            with self._on_stream():  # NCCL's wait() orders the *current* stream after the op
                self._wait(work, op.timeout_s)
        except Exception as e:  # noqa: BLE001 - timeout, dead peer, ...
            self._fail_all(op, f"{op.kind} of {op.nbytes} B failed: {e}")
            return
        finally:
            self._busy = None
        self.ops_done += 1
        _settle(op.fut, res)

    def _fail_all(self, op: _Op, reason: str) -> None:
        self._break(reason)
        _settle(op.fut, exc=TransferError(reason))
        with self._lock:
            stuck = list(self._inflight)
            self._inflight.clear()
        for o, _w, _r in stuck:
            _settle(o.fut, exc=TransferError(f"kv pair is broken: {reason}"))

    def _watch(self) -> None:
        """NOTE: the watchdog for calls that ignore their timeout (a hung NCCL init, a driver
        stall): fails every pending op and breaks the group from outside; the stuck thread is
        abandoned (daemon) and finds its futures already settled if it ever returns."""
        while not self._done.wait(0.5):
            b = self._busy
            if b is not None and time.monotonic() > b[0] + b[1] + self.GRACE_S:
                self._fail_all(b[3], f"watchdog: {b[2]} stuck for {time.monotonic() - b[0]:.1f}s")
                return

    def _wait(self, work, timeout_s: float) -> None:
        if self.backend == "gloo":
            # gloo honours the timeout itself (and closes the pair when it expires)
            work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
            return
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not work.is_completed():  # NCCL: queries the op's CUDA event, never blocks
            if time.monotonic() > deadline:
                raise TimeoutError(f"NCCL op not done after {timeout_s:.1f}s (peer dead or stuck?)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        work.wait()  # raises if the op failed; returns at once when completed

    def _break(self, reason: str, orderly: bool = False) -> None:
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
            pending = []
            while True:
                try:
                    pending.append(self._q.get_nowait())
                except queue.Empty:
                    break
        for op in pending:
            if op is _STOP:
                self._q.put(_STOP)  # NOTE: a queued close still ends the thread
            else:
                _settle(op.fut, exc=TransferError(f"kv pair is broken: {reason}"))
        if not orderly:
            log.warning("kv pair %s broken: %s", self.name[:8], reason)
        pg = self.pg
        try:
            # NOTE: abort, also when orderly: it frees the communicator and a later op fails at
            # once. (gloo's shutdown() here made the process abort at exit now and then.)
            if pg is not None:
                pg.abort()
        except Exception:  # noqa: BLE001 - best effort on a dead group
            log.debug("abort of pair %s failed", self.name[:8], exc_info=True)
        if self.on_broken is not None and not orderly:
            try:
                self.on_broken(reason)
            except Exception:  # noqa: BLE001
                log.exception("on_broken callback failed")


def _settle(fut: concurrent.futures.Future, result=None, exc: BaseException | None = None) -> None:
    """Set a future once; a second outcome (the watchdog got there first) is dropped."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _check_buffer(out: torch.Tensor, nbytes: int, device: torch.device) -> None:
    if out.dtype != torch.uint8 or out.numel() < nbytes or out.device != device:
        raise ValueError("recv buffer must be uint8, on the group's device, >= nbytes")
