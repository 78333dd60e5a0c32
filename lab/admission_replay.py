"""Replay a serving-bench run's admitted requests through the gateway's TTFT estimators, in the
order the gateway saw them (decided at send + gateway queue, observed at the first token), and
compare their errors on the requests sent after the first quarter. Needs rows with `parts`
(bench/serve_client.PARTS). The `queue, median of 64` variant is the queue model with the
Calibrator the gateway ran before the fit (`--admission-ttft-model queue`); `fit` is TtftFit
(`fit`, the default), the product classes in both.

What the fit sees: rows that logged the steps ahead (`ahead_*` parts) are replayed with them;
older rows get them rebuilt by a PrefillClock fed with the admitted requests themselves (admit
at the decision, done at the first token), which cannot know: the replica's polled queue (other
clients' prompts), the times exactly (the client's send plus the gateway's queue: the HTTP hop
moves each by 1-12 ms), the prefill call's end (a few ms before the first token) and the step
budget (--budget, the GPU default). No replay knows which requests another model would have
admitted: the admitted set and their outcomes stay those of the run.

    python -m lab.admission_replay RUN.json [--rate R] [--budget 2048]
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from gateway.calibration import Calibrator
from gateway.prefill_clock import Ahead, PrefillClock
from gateway.ttft_fit import TtftFit

LOAD_BINS = ((0, 1), (1, 500), (500, 1500), (1500, 3000), (3000, 10**9))  # tokens ahead


def rows_of(path: str, rate: float | None) -> list[dict]:
    runs = json.load(open(path))["results"]["runs"]
    run = next(r for r in runs if rate is None or r.get("rate") == rate)
    return [x for x in run["requests"] if x["status"] == "ok" and "parts" in x]


def own_tokens(x: dict) -> int:
    p = x["parts"]
    cached = p.get("predicted_cached_tokens", x.get("cached_tokens") or 0)
    return max(int(x["prompt_tokens"] - cached), 1)


def logged_ahead(x: dict, budget: int | None) -> Ahead | None:
    p = x["parts"]
    if "ahead_running_tokens" not in p:
        return None
    return Ahead(int(p["ahead_running_tokens"]), int(p["ahead_queued_tokens"]),
                 p["ahead_elapsed_ms"], p["ahead_tokens_per_s"] / 1e3, budget)


class QueueModel:
    """The raw queue model of the run, corrected by a Calibrator."""

    def __init__(self, cal: Calibrator):
        self.cal = cal

    def predict(self, x: dict, ahead: Ahead):
        p = x["parts"]
        return self.cal.correct(p["predicted_raw_ttft_ms"], int(p["predicted_ttft_bucket"])), None

    def observe(self, x: dict, est: float, state) -> None:
        p = x["parts"]
        self.cal.observe(p["predicted_raw_ttft_ms"], est, x["gw_ttft_ms"],
                         int(p["predicted_ttft_bucket"]))


class FitModel(QueueModel):
    """Predictor's TTFT with the fit on: TtftFit once fitted (bounded by the queue model as in
    Predictor.predict), the queue model and its Calibrator before."""

    def __init__(self, fit: TtftFit | None = None):
        super().__init__(Calibrator(additive=True, factor_window=64))
        self.fit = fit if fit is not None else TtftFit()

    def predict(self, x: dict, ahead: Ahead):
        f = self.fit.sample(ahead, own_tokens(x))
        est, _ = super().predict(x, ahead)
        v = self.fit.predict(f)
        if v is not None:
            p = x["parts"]
            est = min(max(v, p["predicted_idle_ttft_ms"] / 2), 4 * p["predicted_raw_ttft_ms"])
        return est, f

    def observe(self, x: dict, est: float, state) -> None:
        super().observe(x, est, state)
        self.fit.add(state, x["gw_ttft_ms"])


class Ablated(TtftFit):
    """TtftFit with some regressors held at 0 (indexes into ttft_fit.design's columns)."""

    def __init__(self, drop: tuple[int, ...]):
        super().__init__()
        self.drop = list(drop)

    def design(self, s: np.ndarray, r: float) -> np.ndarray:
        x = super().design(s, r)
        x[:, self.drop] = 0.0
        return x


def replay(rows: list[dict], model, budget: int | None = 2048) -> dict:
    """Every request predicted at its decision from what was observed before -> APE figures."""
    ev = []
    for i, x in enumerate(rows):
        td = x["send_s"] + x["parts"].get("queue_ms", 0.0) / 1e3
        ev += [(td, 0, i), (td + x["gw_ttft_ms"] / 1e3, 1, i)]
    clock, keys, est, state, ahead_tok = PrefillClock(), {}, {}, {}, {}
    for t, kind, i in sorted(ev):
        x = rows[i]
        if kind == 0:
            a = logged_ahead(x, budget) or clock.ahead(t, budget)
            ahead_tok[i] = a.running_tokens + a.queued_tokens
            est[i], state[i] = model.predict(x, a)
            keys[i] = clock.admit(own_tokens(x), t)
        else:
            clock.done(keys[i], t)
            model.observe(x, est[i], state[i])
    t_end = max(x["send_s"] for x in rows)
    steady = [i for i, x in enumerate(rows) if x["send_s"] > t_end / 4]
    e = np.array([est[i] for i in steady])
    got = np.array([rows[i]["gw_ttft_ms"] for i in steady])
    logged = np.array([rows[i]["pred_ttft_ms"] for i in steady])
    ahead = np.array([ahead_tok[i] for i in steady])
    ape = abs(e - got) / got
    by_load = []
    for lo, hi in LOAD_BINS:
        m = (ahead >= lo) & (ahead < hi)
        by_load.append((lo, hi, int(m.sum()), float(np.median(ape[m])) if m.any() else None))
    return {"ape": float(np.median(ape)), "ape_p90": float(np.percentile(ape, 90)),
            "logged_ape": float(np.median(abs(logged - got) / got)),
            "vs_logged": float(np.median(e / logged)), "n": len(steady), "by_load": by_load}


def oracle(rows: list[dict]) -> float:
    """The best constant correction c + k * raw in hindsight (a floor for corrections of the
    queue model alone)."""
    t_end = max(x["send_s"] for x in rows)
    s = [x for x in rows if x["send_s"] > t_end / 4]
    got = np.array([x["gw_ttft_ms"] for x in s])
    raw = np.array([x["parts"]["predicted_raw_ttft_ms"] for x in s])
    return min(float(np.median(abs(c + k * raw - got) / got))
               for k in np.linspace(0.5, 3.0, 51) for c in np.linspace(-30, 40, 36))


def variants() -> dict:
    v = {"queue, ewma (alpha 0.15)": lambda: QueueModel(Calibrator(additive=True)),
         "queue, ewma (alpha 0.05)": lambda: QueueModel(Calibrator(additive=True, alpha=0.05))}
    for w in (32, 64, 128):
        v[f"queue, median of {w}"] = lambda w=w: QueueModel(
            Calibrator(additive=True, factor_window=w))
    v["fit"] = FitModel
    for name, drop in (("joining", (5,)), ("rest", (2,)), ("busy, rest, joining", (1, 2, 5))):
        v[f"fit without {name}"] = lambda drop=drop: FitModel(Ablated(drop))
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.admission_replay")
    p.add_argument("run")
    p.add_argument("--rate", type=float)
    p.add_argument("--budget", type=int, default=2048,
                   help="the prefill replica's step token budget (0: none)")
    a = p.parse_args(argv)
    rows = rows_of(a.run, a.rate)
    logged = sum("ahead_running_tokens" in x["parts"] for x in rows)
    print(f"{len(rows)} admitted requests ({logged} with the steps ahead logged, the rest "
          f"rebuilt); best constant correction of the queue model in hindsight: APE "
          f"{oracle(rows):.3f}")
    bins = "  ".join(f"{lo}-{hi if hi < 10**9 else ''}" for lo, hi in LOAD_BINS)
    print(f"{'variant':32s} APE    p90    (logged; replay / logged; n)  by tokens ahead {bins}")
    for name, make in variants().items():
        r = replay(rows, make(), a.budget or None)
        loads = " ".join(f"{v:.3f}({n})" if v is not None else "-" for _, _, n, v in r["by_load"])
        print(f"{name:32s} {r['ape']:.3f}  {r['ape_p90']:.3f}  ({r['logged_ape']:.3f}; "
              f"{r['vs_logged']:.3f}; {r['n']})  {loads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
