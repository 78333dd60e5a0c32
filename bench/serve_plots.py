"""PNG plots for bench/serve.py (matplotlib, Agg backend: no display needed).

    plot_cdfs({"A": samples_a, "B": samples_b}, "x-cdf.png")   # TTFT / TPOT / ITL / e2e CDFs
    plot_load({"admission": [summary, ...]}, slo, "x-load.png")  # goodput, P99s vs offered load
    plot_ab(comparison, "x-ab.png")                              # P99 deltas with intervals, KS
"""
from __future__ import annotations

import math

import numpy as np

_TITLES = {"ttft_ms": "TTFT (ms)", "tpot_ms": "TPOT (ms)", "itl_ms": "inter-token latency (ms)",
           "e2e_ms": "end-to-end latency (ms)"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log(ax, axis: str) -> None:
    """Log scale with plain numbers on the major ticks and no minor labels."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    getattr(ax, f"set_{axis}scale")("log")
    a = getattr(ax, f"{axis}axis")
    f = ScalarFormatter()
    f.set_scientific(False)
    a.set_major_formatter(f)
    a.set_minor_formatter(NullFormatter())


def _slo_line(draw, limit) -> None:
    """The SLO as a dashed red line (draw: ax.axvline or ax.axhline); none without one."""
    if limit:
        draw(limit, color="red", ls="--", lw=1, label=f"SLO {limit:g} ms")


def _save(fig, path: str, axes=(), title: str | None = None) -> str:
    """A grid and a legend on each of `axes`, the title over all, the PNG at path; -> path."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_cdfs(runs: dict[str, dict[str, list[float]]], path: str, title: str = "",
              slo: dict | None = None) -> str:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, m in zip(axes.flat, _TITLES):
        for label, sm in runs.items():
            xs = np.sort(np.asarray(sm.get(m, []), float))
            if len(xs):
                ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post",
                        label=f"{label} (n={len(xs)})")
        _slo_line(ax.axvline, (slo or {}).get(m))
        ax.set_xlabel(_TITLES[m])
        ax.set_ylabel("fraction of samples")
        if ax.has_data() and min((min(sm.get(m) or [1.0]) for sm in runs.values())) > 0:
            _log(ax, "x")
    return _save(fig, path, axes.flat, title or "latency CDFs")


def plot_load(series: dict[str, list[dict]], path: str, title: str = "",
              slo: dict | None = None) -> str:
    """series: label -> summaries (bench.serve_stats.summarize) with offered_rate set."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for label, rows in series.items():
        rows = sorted((r for r in rows if r.get("offered_rate")), key=lambda r: r["offered_rate"])
        x = [r["offered_rate"] for r in rows]
        axes[0].plot(x, [r["goodput_rps"] for r in rows], "o-", label=f"{label}: goodput")
        axes[0].plot(x, [r["throughput_rps"] for r in rows], "x--", alpha=0.6,
                     label=f"{label}: throughput")
        axes[1].plot(x, [r["ttft_ms_p99"] for r in rows], "o-", label=label)
        axes[2].plot(x, [r["tpot_ms_p99"] for r in rows], "o-", label=label)
    if series:
        top = max((r["offered_rate"] for rows in series.values() for r in rows
                   if r.get("offered_rate")), default=1.0)
        axes[0].plot([0, top], [0, top], color="grey", lw=0.8, ls=":", label="offered")
    for ax, what, key in ((axes[1], "P99 TTFT (ms)", "ttft_ms"), (axes[2], "P99 TPOT (ms)", "tpot_ms")):
        ax.set_ylabel(what)
        _slo_line(ax.axhline, (slo or {}).get(key))
        if ax.has_data():
            _log(ax, "y")
    axes[0].set_ylabel("requests / s")
    for ax in axes:
        ax.set_xlabel("offered load (requests / s)")
    return _save(fig, path, axes, title or "goodput and tail latency against offered load")


def plot_ab(cmp: dict, path: str, labels: tuple[str, str] = ("A", "B"), title: str = "") -> str:
    """P99 delta (B - A) per metric with its bootstrap interval; KS p-value on each bar."""
    plt = _plt()
    ms = [m for m in _TITLES if m in cmp and not math.isnan(cmp[m].get("ks_p", float("nan")))]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if ms:
        d = [cmp[m]["p99_delta"] for m in ms]
        err = [[cmp[m]["p99_delta"] - cmp[m]["p99_delta_lo"] for m in ms],
               [cmp[m]["p99_delta_hi"] - cmp[m]["p99_delta"] for m in ms]]
        colors = ["tab:red" if cmp[m]["p99_delta_lo"] > 0 else "tab:green" if
                  cmp[m]["p99_delta_hi"] < 0 else "tab:grey" for m in ms]
        ax.bar(range(len(ms)), d, yerr=err, capsize=6, color=colors, alpha=0.8)
        for i, m in enumerate(ms):
            top = max(cmp[m]["p99_delta_hi"], 0.0)
            ax.annotate(f"KS p={cmp[m]['ks_p']:.2g}\nD={cmp[m]['ks_stat']:.2f}", (i, top),
                        textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
        ax.set_xticks(range(len(ms)), [_TITLES[m] for m in ms], fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel(f"P99 {labels[1]} - P99 {labels[0]} (ms)")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title((title or f"A/B: {labels[0]} vs {labels[1]} under one trace")
                 + "\nP99 delta, 95% bootstrap interval; KS test per metric", fontsize=10)
    ax.margins(y=0.2)
    return _save(fig, path)
