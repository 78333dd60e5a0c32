"""bench/step_profile.py's timeline folding (pure Python; the profiler run needs a GPU)."""
import pytest

torch = pytest.importorskip("torch")

from bench.step_profile import layer_pattern, per_position  # noqa: E402


def _step(layers, pattern, prologue=("embed", "cos", "sin"), first_extra=("rmsnorm",), epilogue=("norm", "lm_head")):
    """Synthetic kernels: each pattern entry (name, duration, overlap with the previous end)."""
    names = list(prologue) + list(first_extra)
    specs = [(n, 2.0, 0.0) for n in names]
    for _ in range(layers):
        specs += list(pattern)
    specs += [(n, 3.0, 0.0) for n in epilogue]
    out, t = [], 0.0
    for name, dur, overlap in specs:
        start = t - overlap
        out.append((name, start, start + dur))
        t = start + dur
    return out


def test_layer_pattern_and_medians():
    pat = [("qkv", 13.0, 1.0), ("split", 8.0, 0.5), ("reduce", 2.0, 1.5), ("o_proj", 10.0, 2.0),
           ("gate_up", 60.0, 1.0), ("down", 30.0, 0.0)]
    ks = _step(32, pat)
    assert layer_pattern([k[0] for k in ks], 32) == (4, 6)
    rows = per_position(ks, 32)
    assert [r["kernel"] for r in rows] == ["qkv", "split", "reduce", "o_proj", "gate_up", "down"]
    assert all(r["layers"] == 32 for r in rows)
    got = {r["kernel"]: (r["median_us"], r["adds_us"]) for r in rows}
    assert got["qkv"] == (13.0, 12.0) and got["o_proj"] == (10.0, 8.0) and got["down"] == (30.0, 30.0)


def test_no_pattern_is_empty():
    ks = [(f"k{i}", float(i), float(i) + 0.5) for i in range(10)]
    assert per_position(ks, 4) == []
