"""Where a stream's inter-token gaps open: the mean gap each hop measured over one case, from
its own ITL histogram (decode: between the engine outputs it hands on; gateway: between the
tokens it sends), beside the client's (bench.pd_clients.trace_stats). Equal means at decode and
at the client put the time in the engine; a jump between two hops puts it in the later one."""
from __future__ import annotations

from bench.pd_clients import scrape_metrics

_ITL = "splitserve_inter_token_latency_seconds"


def snapshot(urls: dict[str, str]) -> dict[str, float]:
    """{hop: metrics url} -> {'hop:series': value} of each hop's ITL sum and count."""
    out = {}
    for hop, url in urls.items():
        for k, v in scrape_metrics(url, _ITL + "_(?:sum|count)").items():
            out[f"{hop}:{k}"] = v
    return out


def itl_means(before: dict, after: dict) -> dict[str, float]:
    """{'<hop>_itl_ms_mean': mean gap in ms over the case} for each hop that saw gaps."""
    out = {}
    hops = {k.split(":", 1)[0] for k in after}
    for hop in sorted(hops):
        d = {k.split(":", 1)[1]: after[k] - before.get(k, 0.0) for k in after if k.startswith(hop + ":")}
        s = sum(v for k, v in d.items() if k.startswith(_ITL + "_sum"))
        n = sum(v for k, v in d.items() if k.startswith(_ITL + "_count"))
        if n > 0:
            out[f"{hop}_itl_ms_mean"] = s / n * 1e3
    return out
