"""Statistics for bench/serve.py: per-request latencies from `Outcome`s, percentiles, SLO
attainment, goodput, and the A/B comparison (KS test, P99 delta with a bootstrap interval).

Per request (times from the client's send): TTFT = first token; TPOT = (last token - first
token) / (tokens - 1); ITL = every gap between consecutive tokens (a message carrying several
tokens spreads its gap over them); e2e = the response's end. A request meets its SLO when it
finished (status ok) with TTFT <= ttft_ms and TPOT <= tpot_ms (an SLO not set always holds;
a one-token answer has no TPOT and meets that half). Goodput = requests meeting the SLO per
second of the run's wall time (first send to last response); throughput counts every finished
request and output token over the same time. Where the gateway reports its admission
estimates (splitserve timings), each row keeps them (pred_ttft_ms, pred_tpot_ms, and
gw_ttft_ms, the TTFT they predict: from the admit decision) and the summary their median
absolute percentage error.

The A/B comparison treats each metric's values as samples: right for the per-request ones
(TTFT, TPOT, e2e); the gaps of one request are not independent, so ITL's KS p-value is
optimistic (small differences come out "significant").
"""
from __future__ import annotations

import math

import numpy as np

from bench.serve_client import Outcome

PCTS = (50, 90, 99)
METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def token_times(o: Outcome) -> list[float]:
    out, prev = [], None
    for t, n in o.events:
        if prev is None:
            out += [t] * n
        else:
            out += [prev + (t - prev) * (k + 1) / n for k in range(n)]
        prev = t
    return out


def per_request(o: Outcome) -> dict:
    """-> ttft_ms, tpot_ms (None for one token), itl_ms (list), e2e_ms, tokens; ok only."""
    ts = token_times(o)
    ttft = (ts[0] - o.t_send) * 1e3
    tpot = (ts[-1] - ts[0]) / (len(ts) - 1) * 1e3 if len(ts) > 1 else None
    itl = [(b - a) * 1e3 for a, b in zip(ts, ts[1:])]
    return {"ttft_ms": ttft, "tpot_ms": tpot, "itl_ms": itl, "e2e_ms": (o.t_end - o.t_send) * 1e3,
            "tokens": len(ts)}


def meets(r: dict, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    return (ttft_ms is None or r["ttft_ms"] <= ttft_ms) and \
        (tpot_ms is None or r["tpot_ms"] is None or r["tpot_ms"] <= tpot_ms)


def samples(outs: list[Outcome]) -> dict[str, list[float]]:
    """Metric -> values over the finished requests (itl_ms: every gap of every request)."""
    d = {m: [] for m in METRICS}
    for o in outs:
        if o.status != "ok":
            continue
        r = per_request(o)
        d["ttft_ms"].append(r["ttft_ms"])
        d["e2e_ms"].append(r["e2e_ms"])
        d["itl_ms"] += r["itl_ms"]
        if r["tpot_ms"] is not None:
            d["tpot_ms"].append(r["tpot_ms"])
    return d


def pct(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(outs: list[Outcome], wall_s: float, ttft_ms: float | None = None,
              tpot_ms: float | None = None, offered_rate: float | None = None) -> dict:
    ok = [o for o in outs if o.status == "ok"]
    rej = [o for o in outs if o.status == "rejected"]
    err = [o for o in outs if o.status == "error"]
    good = sum(meets(per_request(o), ttft_ms, tpot_ms) for o in ok)
    sm = samples(outs)
    tokens = sum(per_request(o)["tokens"] for o in ok)
    wall = max(wall_s, 1e-9)
    s = {"offered_rate": offered_rate, "requests": len(outs), "completed": len(ok),
         "rejected": len(rej), "errors": len(err), "wall_s": wall_s,
         "throughput_rps": len(ok) / wall, "output_tok_s": tokens / wall,
         "goodput_rps": good / wall, "slo_met": good,
         "slo_attainment": good / len(outs) if outs else float("nan"),
         "slo_attainment_admitted": good / len(ok) if ok else float("nan")}
    for m in METRICS:
        xs = sm[m]
        s[f"{m}_mean"] = float(np.mean(xs)) if xs else float("nan")
        for q in PCTS:
            s[f"{m}_p{q}"] = pct(xs, q)
    ra = [o.retry_after_s for o in rej if o.retry_after_s is not None]
    s["retry_after_s_median"] = pct(ra, 50)
    s["rejected_with_retry_after"] = len(ra)
    pre = [o.predicted_ms for o in rej if o.predicted_ms is not None]
    s["rejected_predicted_ms_median"] = pct(pre, 50)
    cached = [(o.cached_tokens or 0, o.prompt_tokens) for o in ok if o.prompt_tokens]
    s["prefix_cache_hit_rate"] = (sum(c for c, _ in cached) / sum(p for _, p in cached)
                                  if cached else float("nan"))
    ape = prediction_errors(ok)
    for w in ("ttft", "tpot"):
        s[f"{w}_prediction_ape_median"] = pct(ape[w], 50)
        s[f"{w}_prediction_ape_p90"] = pct(ape[w], 90)
    # steady load: requests sent after the first quarter of the arrivals (the models and their
    # calibration start each run from what the previous load taught them)
    t0 = min((o.t_send for o in outs), default=0.0)
    t_last = max((o.t_send for o in outs), default=0.0)
    steady = prediction_errors([o for o in ok if o.t_send >= t0 + 0.25 * (t_last - t0)])
    for w in ("ttft", "tpot"):
        s[f"{w}_prediction_ape_median_steady"] = pct(steady[w], 50)
    qs = [o.queue_ms for o in ok if o.queue_ms is not None]
    s["gateway_queue_ms_p50"] = pct(qs, 50)
    errs: dict[str, int] = {}
    for o in err:
        errs[o.code or "?"] = errs.get(o.code or "?", 0) + 1
    s["errors_by_code"] = errs
    return s


def prediction_errors(ok: list[Outcome]) -> dict[str, list[float]]:
    """Absolute percentage errors of the gateway's per-request estimates: TTFT against the
    gateway's own TTFT from the admit decision, TPOT against the client's TPOT."""
    out = {"ttft": [], "tpot": []}
    for o in ok:
        if o.pred_ttft_ms and o.gw_ttft_ms and o.gw_ttft_ms > 0:
            out["ttft"].append(abs(o.pred_ttft_ms - o.gw_ttft_ms) / o.gw_ttft_ms)
        tpot = per_request(o)["tpot_ms"] if o.pred_tpot_ms else None
        if tpot:
            out["tpot"].append(abs(o.pred_tpot_ms - tpot) / tpot)
    return out


def outcome_rows(outs: list[Outcome]) -> list[dict]:
    """Per-request records for the JSON (times relative to the first send)."""
    t0 = min((o.t_send for o in outs), default=0.0)
    rows = []
    for o in outs:
        r = {"idx": o.idx, "send_s": round(o.t_send - t0, 6), "status": o.status}
        if o.status == "ok":
            pr = per_request(o)
            r.update(ttft_ms=round(pr["ttft_ms"], 3), e2e_ms=round(pr["e2e_ms"], 3),
                     tokens=pr["tokens"], prompt_tokens=o.prompt_tokens,
                     cached_tokens=o.cached_tokens)
            if pr["tpot_ms"] is not None:
                r["tpot_ms"] = round(pr["tpot_ms"], 3)
            if o.queue_ms is not None:
                r["queue_ms"] = round(o.queue_ms, 3)
            for k in ("pred_ttft_ms", "pred_tpot_ms", "gw_ttft_ms"):
                if getattr(o, k) is not None:
                    r[k] = round(getattr(o, k), 3)
            if getattr(o, "parts", None):
                r["parts"] = {k: round(float(v), 3) for k, v in o.parts.items()}
        else:
            r.update(code=o.code, error=o.error, retry_after_s=o.retry_after_s,
                     predicted_ms=o.predicted_ms)
        rows.append(r)
    return rows


# ---- A/B ----------------------------------------------------------------------------------

def bootstrap_pct_delta(a, b, q: float = 99.0, n_boot: int = 2000, seed: int = 0,
                        level: float = 0.95) -> dict:
    """P_q(b) - P_q(a) with a percentile-bootstrap interval (each side resampled on its own)."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        return {"delta": float("nan"), "lo": float("nan"), "hi": float("nan"), "n_boot": 0}
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, len(a), (n_boot, len(a)))
    ib = rng.integers(0, len(b), (n_boot, len(b)))
    d = np.percentile(b[ib], q, axis=1) - np.percentile(a[ia], q, axis=1)
    lo, hi = np.percentile(d, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return {"delta": float(np.percentile(b, q) - np.percentile(a, q)), "lo": float(lo),
            "hi": float(hi), "n_boot": n_boot, "level": level}


def compare(sa: dict[str, list[float]], sb: dict[str, list[float]], n_boot: int = 2000,
            seed: int = 0) -> dict:
    """Per metric: KS statistic and p-value (scipy.stats.ks_2samp), P50/P99 of both sides and
    the P99 delta (B - A) with its bootstrap interval."""
    from scipy.stats import ks_2samp

    out = {}
    for m in METRICS:
        a, b = sa.get(m, []), sb.get(m, [])
        if len(a) < 2 or len(b) < 2:
            out[m] = {"n_a": len(a), "n_b": len(b), "ks_stat": float("nan"), "ks_p": float("nan")}
            continue
        ks = ks_2samp(a, b)
        boot = bootstrap_pct_delta(a, b, 99.0, n_boot, seed)
        out[m] = {"n_a": len(a), "n_b": len(b), "ks_stat": float(ks.statistic),
                  "ks_p": float(ks.pvalue), "p50_a": pct(a, 50), "p50_b": pct(b, 50),
                  "p99_a": pct(a, 99), "p99_b": pct(b, 99), "p99_delta": boot["delta"],
                  "p99_delta_lo": boot["lo"], "p99_delta_hi": boot["hi"]}
    return out


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))
