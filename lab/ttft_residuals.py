"""Where admission's TTFT error comes from, on a serving-bench run's admitted rows: the prefill
engine's steps as seen in the first tokens (requests whose first tokens come within 5 ms of each
other came out of one step), the logged error by prefill work ahead, and how well each set of
features could explain the TTFT at best (hindsight fits over the steady part: floors, not
predictions; lab/admission_replay.py replays the online ones).

    python -m lab.ttft_residuals RUN.json [--rate R] [--budget 2048]
"""
from __future__ import annotations

import argparse

import numpy as np

from gateway.prefill_clock import PrefillClock
from gateway.ttft_fit import design
from lab.admission_replay import LOAD_BINS, own_tokens, rows_of


def _states(rows: list[dict], budget: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (decision s, first token s, PrefillClock state of each row at its decision) rebuilt
    from the admitted rows, as the replay does."""
    td = np.array([x["send_s"] + x["parts"].get("queue_ms", 0.0) / 1e3 for x in rows])
    tf = td + np.array([x["gw_ttft_ms"] for x in rows]) / 1e3
    ev = sorted([(t, 0, i) for i, t in enumerate(td)] + [(t, 1, i) for i, t in enumerate(tf)])
    clock, keys, st = PrefillClock(), {}, np.zeros((len(rows), 7))
    for t, kind, i in ev:
        if kind == 0:
            a = clock.ahead(t, budget)
            st[i] = (a.running_tokens, a.queued_tokens, a.elapsed_ms, a.tokens_per_ms,
                     budget or 0, own_tokens(rows[i]), len(clock))
            keys[i] = clock.admit(own_tokens(rows[i]), t)
        else:
            clock.done(keys[i], t)
    return td, tf, st


def _hindsight(x: np.ndarray, y: np.ndarray, iters: int = 30) -> float:
    """Median APE of the fit of y on x minimising the mean relative error (IRLS)."""
    w = 1 / y
    c = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
    for _ in range(iters):
        r = np.maximum(np.abs(x @ c - y) * w, 1e-3)
        c = np.linalg.lstsq(x * (w / np.sqrt(r))[:, None], y * w / np.sqrt(r), rcond=None)[0]
    return float(np.median(np.abs(x @ c - y) / y))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.ttft_residuals")
    p.add_argument("run")
    p.add_argument("--rate", type=float)
    p.add_argument("--budget", type=int, default=2048)
    a = p.parse_args(argv)
    rows = rows_of(a.run, a.rate)
    td, tf, st = _states(rows, a.budget or None)
    y = np.array([x["gw_ttft_ms"] for x in rows])
    order = np.argsort(tf)
    cuts = np.flatnonzero(np.diff(tf[order]) > 0.005) + 1
    groups = np.split(order, cuts)
    tok = np.array([sum(own_tokens(rows[i]) for i in g) for g in groups])
    size = np.array([len(g) for g in groups])
    print(f"{len(rows)} admitted; first tokens in {len(groups)} groups (steps): prompts a group "
          f"p50/p90/max {np.percentile(size, 50):.0f}/{np.percentile(size, 90):.0f}/{size.max()}, "
          f"tokens {np.percentile(tok, 50):.0f}/{np.percentile(tok, 90):.0f}/{tok.max()}")
    s = np.array([x["send_s"] for x in rows]) > max(x["send_s"] for x in rows) / 4
    ahead = st[:, 0] + st[:, 1]
    logged = np.array([x["pred_ttft_ms"] for x in rows])
    raw = np.array([x["parts"]["predicted_raw_ttft_ms"] for x in rows])
    print("logged TTFT APE (steady) by prompt tokens in flight ahead:")
    for lo, hi in LOAD_BINS:
        m = s & (ahead >= lo) & (ahead < hi)
        if m.any():
            e = np.abs(logged[m] - y[m]) / y[m]
            print(f"  {lo:>5}-{hi if hi < 10**9 else '':<5} n {m.sum():4d}  APE {np.median(e):.3f}  "
                  f"observed / raw {np.median(y[m] / raw[m]):.2f}")
    one, own, busy = np.ones(len(rows)), st[:, 5], (st[:, 0] > 0).astype(float)
    feats = {"raw (queue model)": [one, raw],
             "tokens ahead, own": [one, ahead, own],
             "+ prompts ahead": [one, ahead, own, st[:, 6]],
             "running / queued, elapsed, busy": [one, busy, st[:, 0], st[:, 1], st[:, 2], own]}
    print("hindsight floors (steady rows, one fit over them):")
    for name, cols in feats.items():
        print(f"  {name:34s} APE {_hindsight(np.stack(cols, 1)[s], y[s]):.3f}")
    best = min((_hindsight(design(st[:, :6], r)[s], y[s]), r) for r in np.linspace(0.02, 0.08, 13))
    print(f"  {'TtftFit regressors (best r)':34s} APE {best[0]:.3f} (r {best[1]:.3f} ms/token)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
