"""Where the services' host CPU goes under a streaming load: `splitserve up` with the given engine
flags, N concurrent gRPC streaming clients (closed loop: each sends its next request when one
ends) for the run, and py-spy sampling each service process (gateway, prefill, decode) for a
window in the middle. Prints per process: CPU used (cores), the top functions by self time and
by inclusive time, and the load's tokens/s. Needs py-spy on PATH (`pip install py-spy`).

    python -m lab.host_profile --model dummy:tiny-llama --device cpu --clients 32 --max-tokens 128
    python -m lab.host_profile --model dummy:llama-3.2-1b --device cuda --clients 64 --out DIR
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from bench.pd_clients import grpc_one, random_prompts
from bench.system_procs import free_port, model_info, stop_process, wait_up
from bench.pd_hops import role_pids
from bench.procfs import cpu_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def summarize(raw_path: str, top: int) -> tuple[list, list, int]:
    """py-spy raw (collapsed) stacks -> (top self, top inclusive, samples)."""
    self_t, incl = collections.Counter(), collections.Counter()
    total = 0
    for line in open(raw_path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(n)
        frames = [f for f in stack.split(";") if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        self_t[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    return self_t.most_common(top), incl.most_common(top * 2), total


async def load(addr: str, prompts, max_tokens: int, stop: threading.Event, stats: dict,
               channels: int = 1) -> None:
    import grpc

    from protos import generate_pb2_grpc

    chs = [grpc.aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
           for _ in range(channels)]
    try:
        await asyncio.gather(*(ch.channel_ready() for ch in chs))
        stubs = [generate_pb2_grpc.GenerationStub(ch) for ch in chs]

        async def client(i: int) -> None:
            stub = stubs[i % len(stubs)]
            k = 0
            while not stop.is_set():
                tr = await grpc_one(stub, prompts[(i + k * 7) % len(prompts)], max_tokens, None, 600.0)
                stats["tokens"] += sum(n for _, n in tr.events)
                stats["requests"] += 1
                k += 1
        await asyncio.gather(*(client(i) for i in range(len(prompts) // 4)))
    finally:
        await asyncio.gather(*(ch.close() for ch in chs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.host_profile", allow_abbrev=False)
    ap.add_argument("--model", default="dummy:tiny-llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=float, default=8.0)
    ap.add_argument("--window", type=float, default=10.0, help="py-spy seconds per process (all at once)")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples/s")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--topology", default="split")
    ap.add_argument("--out", default=None, help="keep the raw stacks here")
    ap.add_argument("--channels", type=int, default=1,
                    help="gRPC connections the clients are dealt over (gateway workers: >= their number)")
    ap.add_argument("up_args", nargs="*", help="more `up` flags (after --)")
    a = ap.parse_args(argv)
    if shutil.which("py-spy") is None:
        print("py-spy is not on PATH (pip install py-spy)", file=sys.stderr)
        return 2
    out = a.out or tempfile.mkdtemp(prefix="host_profile-")
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "splitserve_cli", "up", "--http-port", "0", "--grpc-port", "0",
           "--prefill-port", "0", "--decode-port", "0", "--topology", a.topology,
           "--metrics-ports", f"{free_port()},{free_port()}", "--model", a.model]
    if a.device.startswith("cuda"):
        gpu = a.device.partition(":")[2] or "0"
        cmd += ["--prefill-gpu", gpu, "--decode-gpu", gpu, "--kv-cache-bytes", str(12 << 30)]
    else:
        cmd += ["--device", a.device]
    cmd += a.up_args
    log_path = os.path.join(out, "up.log")
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none",
           "PYTHONPATH": os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)}
    up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        _, grpc_addr = wait_up(up, log_path, 900)
        procs = {r if i == 0 else f"{r}-{i}": p for r, pids in role_pids(up.pid).items()
                 if r != "client" for i, p in enumerate(pids)}
        info = model_info(grpc_addr)
        prompts = random_prompts(a.clients * 4, a.prompt_len, info.vocab_size, 1)
        stop, stats = threading.Event(), {"tokens": 0, "requests": 0}
        th = threading.Thread(target=lambda: asyncio.run(load(grpc_addr, prompts, a.max_tokens, stop, stats,
                                                              a.channels)), daemon=True)
        th.start()
        time.sleep(a.warmup)
        c0 = {r: cpu_seconds(p) for r, p in procs.items()}
        tok0, t0 = stats["tokens"], time.monotonic()
        spies = {r: subprocess.Popen(["py-spy", "record", "-p", str(p), "-d", str(int(a.window)),
                                      "-r", str(a.rate), "-f", "raw", "--nonblocking",
                                      "-o", os.path.join(out, f"{r}.txt")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for r, p in procs.items()}
        for s in spies.values():
            s.wait()
        dt = time.monotonic() - t0
        tok_s = (stats["tokens"] - tok0) / dt
        cores = {r: (cpu_seconds(p) - c0[r]) / dt for r, p in procs.items()}
        stop.set()
        th.join(timeout=120)
        print(f"load: {a.clients} clients, {a.prompt_len} in, {a.max_tokens} out: "
              f"{tok_s:.0f} tokens/s over {dt:.1f} s")
        for r in procs:
            path = os.path.join(out, f"{r}.txt")
            if not os.path.exists(path):
                print(f"\n== {r}: no samples (py-spy failed)")
                continue
            tops, incl, total = summarize(path, a.top)
            print(f"\n== {r}: {cores[r]:.2f} cores; {total} samples; "
                  f"{cores[r] / max(tok_s, 1e-9) * 1e6:.0f} us of CPU a token")
            print("  self:")
            for f, n in tops:
                print(f"    {100 * n / total:5.1f}%  {f[:150]}")
            print("  inclusive:")
            for f, n in incl:
                print(f"    {100 * n / total:5.1f}%  {f[:150]}")
        gw = [r for r in procs if r.startswith("gateway")]
        if len(gw) > 1:
            total = sum(cores[r] for r in gw)
            print(f"\n== gateway, {len(gw)} workers: {total:.2f} cores; "
                  f"{total / max(tok_s, 1e-9) * 1e6:.0f} us of CPU a token")
        print(f"\nraw stacks in {out}")
    finally:
        stop_process(up, 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
