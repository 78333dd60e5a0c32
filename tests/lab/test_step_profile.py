"""lab/step_profile.py's timeline folding (pure Python; the profiler run needs a GPU)."""
import pytest

torch = pytest.importorskip("torch")

from lab.step_profile import layer_pattern, per_position  # noqa: E402


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


def _stamps(programs, entry, wait, end, mids=None):
    """An int64 [programs, 8] trace buffer (ns): every program the same stamps, except that
    program i ends i ns later (so the median and last end differ)."""
    b = torch.zeros((programs, 8), dtype=torch.int64)
    b[:, 0] = torch.arange(programs) % 3
    b[:, 1], b[:, 2] = entry, wait
    b[:, 3], b[:, 4] = mids if mids else (entry, entry)
    b[:, 5] = end + torch.arange(programs) * 1000
    return b


def test_stamp_features_relative_to_previous_end():
    from lab.step_profile import stamp_features

    bufs = [("slab_gemv", _stamps(4, 0, 1000, 10_000)),             # ends last at 13 us
            ("decode_split", _stamps(2, 12_000, 14_000, 20_000, (15_000, 18_000))),
            ("decode_reduce", _stamps(1, 19_000, 21_500, 22_000))]
    f = stamp_features(bufs)
    assert [r["sms"] for r in f] == [3, 2, 1]
    assert f[0]["end_last"] == 13.0 and f[0]["wait_first"] == 1.0
    s = f[1]  # relative to 13 us
    assert (s["first_in"], s["wait_first"], s["rope_kv"], s["attended"], s["end_last"]) == \
        (-1.0, 1.0, 2.0, 5.0, 8.0)
    assert "rope_kv" not in f[2] and f[2]["wait_first"] == 0.5 and f[2]["end_last"] == 1.0


def test_fold_stamps_takes_medians_per_position():
    from lab.step_profile import fold_stamps

    def rep(shift):
        feats = [{"kernel": "embed_norm", "programs": 1, "sms": 1, "end_last": 1.0}]
        for layer in range(6):
            feats.append({"kernel": "qkv", "programs": 4, "sms": 4, "wait_first": 1.0 + layer + shift,
                          "end_last": 12.0})
            feats.append({"kernel": "attn", "programs": 8, "sms": 8, "rope_kv": 2.0, "end_last": 8.0 + shift})
        return feats

    rows = fold_stamps([rep(0.0), rep(1.0), rep(2.0)], layers=6)
    got = {r["kernel"]: r for r in rows}
    assert set(got) == {"qkv", "attn"}
    assert got["attn"]["end_last"] == 9.0 and got["attn"]["rope_kv"] == 2.0
    assert got["qkv"]["wait_first"] == 5.0  # median of 1..6, 2..7, 3..8


def test_stamp_features_leave_out_unwritten_rows():
    from lab.step_profile import stamp_features

    b = _stamps(4, 5_000_000_000, 5_000_001_000, 5_000_010_000)
    b[2, 1:6] = 0  # a row no program wrote
    f = stamp_features([("slab_gemv", b)])[0]
    assert f["unwritten"] == 1 and f["end_last"] == 13.0  # program 3: 10 us + 3 ns * 1000
