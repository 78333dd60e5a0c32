"""Where a stream's time goes under load, hop by hop:
- the mean inter-token gap each hop measured over one case, from its own ITL histogram (decode:
  between the engine outputs it hands on; gateway: between the tokens it sends), beside the
  client's (bench.pd_clients.trace_stats): equal means at decode and at the client put the time
  in the engine; a jump between two hops puts it in the later one;
- each process's CPU over the case as a share of one core: a Python service near 1.0 is
  bound by its event loop (the GIL), whatever the GPU could do.
"""
from __future__ import annotations

import os
import time

from bench.system_procs import scrape_metrics
from bench.procfs import cmdline, cpu_seconds, descendants

_ITL = "splitserve_inter_token_latency_seconds"
ROLES = {"gateway": "gateway", "prefill": "prefill_svc", "decode": "decode_svc"}


def snapshot(urls: dict[str, str], pids: dict[str, int] | None = None) -> dict[str, float]:
    """{hop: metrics url} -> {'hop:series': value} of each hop's ITL sum and count; with pids
    ({role: pid or [pids]}: a role's processes summed, e.g. gateway workers) also 'cpu_s:role'
    (CPU seconds so far) and 't' (monotonic seconds)."""
    out = {"t": time.monotonic()}
    for hop, url in urls.items():
        for k, v in scrape_metrics(url, _ITL + "_(?:sum|count)").items():
            out[f"{hop}:{k}"] = v
    for role, pid in (pids or {}).items():
        secs = [cpu_seconds(p) for p in (pid if isinstance(pid, (list, tuple)) else [pid])]
        if secs and None not in secs:
            out[f"cpu_s:{role}"] = sum(secs)
    return out


def itl_means(before: dict, after: dict) -> dict[str, float]:
    """{'<hop>_itl_ms_mean': mean gap in ms over the case} for each hop that saw gaps, and
    {'<role>_cpu_share': CPU seconds / wall seconds} for each process snapshot measured."""
    out = {}
    hops = {k.split(":", 1)[0] for k in after if _ITL in k}
    for hop in sorted(hops):
        d = {k.split(":", 1)[1]: after[k] - before.get(k, 0.0) for k in after if k.startswith(hop + ":")}
        s = sum(v for k, v in d.items() if k.startswith(_ITL + "_sum"))
        n = sum(v for k, v in d.items() if k.startswith(_ITL + "_count"))
        if n > 0:
            out[f"{hop}_itl_ms_mean"] = s / n * 1e3
    wall = after.get("t", 0.0) - before.get("t", 0.0)
    for k in after:
        if k.startswith("cpu_s:") and k in before and wall > 0:
            out[f"{k[6:]}_cpu_share"] = (after[k] - before[k]) / wall
    return out


def role_pids(root: int) -> dict[str, list[int]]:
    """{role: [pids]} of the services under process root (`splitserve up`), by their module name
    on the command line (`python -m decode_svc ...`; several for gateway workers), and
    'client': [this process]."""
    out: dict[str, list[int]] = {}
    for pid in descendants(root):
        argv = cmdline(pid)
        for role, module in ROLES.items():
            if module in argv:
                out.setdefault(role, []).append(pid)
    out["client"] = [os.getpid()]
    return out


def service_pids(root: int) -> dict[str, int]:
    """{role: pid}: the first process of each role of role_pids."""
    return {role: pids[0] for role, pids in role_pids(root).items()}
