"""The planner's queueing model and its search for the smallest shape meeting the SLOs.

Prefill: P replicas, one prompt at a time each, fed first-come-first-served from the gateway:
an M/G/c queue (Poisson arrivals at `rate`, service time prefill_ms of a prompt length drawn
from the workload). Its wait follows Erlang C with the Allen-Cunneen correction for the
service-time spread: P(wait > t) ~= C(c, a) * exp(-theta t), theta = (c/E[S] - rate) * 2 /
(1 + cv_S^2). TTFT at quantile q ~= wait_q + S(len_q) + handoff(len_q): a sum of quantiles,
so an upper bound of the true quantile (the choice errs towards one replica too many).
Packing several short prompts into one step (chunked prefill) is not modelled: conservative.

Decode: D replicas share the running requests evenly. A replica with B running requests
steps in step_ms(B, ctx) and each gets one token per step, so by Little's law
B = (rate / D) * out_len * step_ms(B, ctx), solved in closed form. The count of running
requests is Poisson (an M/G/inf population) with mean B: TPOT at quantile q = step_ms(B_q),
B_q = B + z_q sqrt(B). A replica also holds at most max_batch requests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from planner.calibration import Calibration

GRID = 64  # length quantiles the workload's distribution is summarised by


@dataclass(frozen=True)
class Workload:
    rate: float                 # requests / s (Poisson)
    input_len: float            # mean prompt tokens
    output_len: float           # mean generated tokens
    input_cv: float = 0.0       # coefficient of variation (lognormal); 0: fixed length
    output_cv: float = 0.0
    ttft_ms: float = 0.0        # SLOs at `quantile`
    tpot_ms: float = 0.0
    quantile: float = 0.9

    def __post_init__(self):
        for name in ("rate", "input_len", "output_len", "ttft_ms", "tpot_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.5 <= self.quantile < 1:
            raise ValueError(f"quantile must be in [0.5, 1), got {self.quantile}")
        if self.input_cv < 0 or self.output_cv < 0:
            raise ValueError("input_cv / output_cv must be >= 0")


def lengths(mean: float, cv: float, n: int = GRID) -> list[float]:
    """n equally likely lengths summarising a lognormal of this mean and cv (midpoint quantiles)."""
    if cv == 0:
        return [mean] * n
    s2 = math.log1p(cv * cv)
    mu = math.log(mean) - s2 / 2
    nd = NormalDist()
    return [math.exp(mu + math.sqrt(s2) * nd.inv_cdf((i + 0.5) / n)) for i in range(n)]


def length_quantile(mean: float, cv: float, q: float) -> float:
    if cv == 0:
        return mean
    s2 = math.log1p(cv * cv)
    return math.exp(math.log(mean) - s2 / 2 + math.sqrt(s2) * NormalDist().inv_cdf(q))


def erlang_c(c: int, a: float) -> float:
    """Probability an arrival waits in M/M/c with offered load a = rate * E[S] (< c)."""
    if a >= c:
        return 1.0
    term, total = 1.0, 1.0  # a^k / k!, summed for k < c
    for k in range(1, c):
        term *= a / k
        total += term
    last = term * a / c * c / (c - a)  # a^c / c! * c / (c - a)
    return last / (total + last)


@dataclass(frozen=True)
class PrefillPrediction:
    replicas: int
    utilization: float
    wait_prob: float
    wait_ms_mean: float
    wait_ms_q: float
    ttft_ms_mean: float
    ttft_ms_q: float
    stable: bool


def predict_prefill(w: Workload, cal: Calibration, replicas: int) -> PrefillPrediction:
    ls = lengths(w.input_len, w.input_cv)
    s = [cal.prefill_ms(n) for n in ls]
    es = sum(s) / len(s)
    var = sum((x - es) ** 2 for x in s) / len(s)
    lam = w.rate / 1e3  # per ms
    a = lam * es
    rho = a / replicas
    hand = sum(cal.handoff_ms(n) for n in ls) / len(ls) + cal.ttft_overhead_ms
    if rho >= 1:
        inf = float("inf")
        return PrefillPrediction(replicas, rho, 1.0, inf, inf, inf, inf, False)
    pw = erlang_c(replicas, a)
    theta = (replicas / es - lam) * 2 / (1 + var / (es * es))
    wq_mean = pw / theta
    wq_q = max(0.0, math.log(pw / (1 - w.quantile)) / theta) if pw > 0 else 0.0
    lq = length_quantile(w.input_len, w.input_cv, w.quantile)
    return PrefillPrediction(replicas, rho, pw, wq_mean, wq_q, wq_mean + es + hand,
                             wq_q + cal.prefill_ms(lq) + cal.handoff_ms(lq) + cal.ttft_overhead_ms, True)


@dataclass(frozen=True)
class DecodePrediction:
    replicas: int
    batch_mean: float
    batch_q: float
    tpot_ms_mean: float
    tpot_ms_q: float
    tokens_per_s: float
    stable: bool


def predict_decode(w: Workload, cal: Calibration, replicas: int, max_batch: int = 256) -> DecodePrediction:
    ctx = w.input_len + w.output_len / 2  # mean context over a request's decode
    d0, d1, d2 = cal.decode
    k = (w.rate / replicas) * w.output_len / 1e3  # requests entering a replica per ms x tokens each
    denom = 1 - k * (d1 + d2 * ctx)
    tok_s = w.rate * w.output_len
    if denom <= 0:
        inf = float("inf")
        return DecodePrediction(replicas, inf, inf, inf, inf, tok_s, False)
    b = k * d0 / denom
    bq = b + NormalDist().inv_cdf(w.quantile) * math.sqrt(b)
    return DecodePrediction(replicas, b, bq, cal.step_ms(b, ctx), cal.step_ms(bq, ctx), tok_s,
                            bq <= max_batch)


@dataclass(frozen=True)
class Plan:
    prefill: PrefillPrediction
    decode: DecodePrediction
    prefill_table: list[PrefillPrediction]
    decode_table: list[DecodePrediction]

    @property
    def shape(self) -> str:
        return f"{self.prefill.replicas}P{self.decode.replicas}D"


def meets_ttft(p: PrefillPrediction, w: Workload) -> bool:
    return p.stable and p.ttft_ms_q <= w.ttft_ms


def meets_tpot(d: DecodePrediction, w: Workload) -> bool:
    return d.stable and d.tpot_ms_q <= w.tpot_ms


def plan(w: Workload, cal: Calibration, max_batch: int = 256, max_replicas: int = 1024) -> Plan:
    """The fewest prefill and decode replicas meeting the SLOs (each side on its own: prefill
    and decode run on separate GPUs), with the neighbouring counts for the table. ValueError
    when an SLO cannot be met by any count (an idle replica is already too slow)."""
    lq = length_quantile(w.input_len, w.input_cv, w.quantile)
    if cal.prefill_ms(lq) + cal.handoff_ms(lq) + cal.ttft_overhead_ms > w.ttft_ms:
        raise ValueError(f"TTFT SLO {w.ttft_ms:g} ms is below the prefill time ({cal.prefill_ms(lq):.1f} ms) "
                         f"+ KV handoff ({cal.handoff_ms(lq):.1f} ms) + overhead ({cal.ttft_overhead_ms:g} ms) "
                         f"of a p{w.quantile * 100:g} prompt on an idle replica: no replica count meets it")
    if cal.step_ms(1, w.input_len + w.output_len / 2) > w.tpot_ms:
        raise ValueError(f"TPOT SLO {w.tpot_ms:g} ms is below one decode step at batch 1: "
                         "no replica count meets it")
    p = next((c for c in range(1, max_replicas + 1) if meets_ttft(predict_prefill(w, cal, c), w)), None)
    d = next((c for c in range(1, max_replicas + 1)
              if meets_tpot(predict_decode(w, cal, c, max_batch), w)), None)
    if p is None or d is None:
        raise ValueError(f"more than {max_replicas} replicas needed")
    pt = [predict_prefill(w, cal, c) for c in range(max(1, p - 2), p + 2)]
    dt = [predict_decode(w, cal, c, max_batch) for c in range(max(1, d - 2), d + 2)]
    return Plan(predict_prefill(w, cal, p), predict_decode(w, cal, d, max_batch), pt, dt)
