"""bench/engine_costs.py on a tiny dummy model: its rows are what planner.calibration reads."""
from __future__ import annotations

import glob
import json

from bench import engine_costs
from planner.calibration import calibrate, points_from_bench


def test_rows_calibrate_the_planner(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_BENCH_DIR", str(tmp_path))
    assert engine_costs.main(["--model", "dummy:tiny-llama", "--shape", "tiny-llama", "--threads", "1",
                              "--prefill", "4,16", "--batches", "1,2", "--contexts", "4,8",
                              "--mixed", "2x4+8", "--reps", "1"]) == 0
    [path] = glob.glob(str(tmp_path / "engine_costs-*.json"))
    pre, dec = points_from_bench(path, "tiny-llama")
    assert [n for n, _ in pre] == [4, 16] and len(dec) == 4
    cal = calibrate(pre, dec)
    assert cal.prefill_ms(16) > 0 and cal.step_ms(2, 8) > 0


def test_contend_times_the_rows_beside_another_busy_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_BENCH_DIR", str(tmp_path))
    assert engine_costs.main(["--model", "dummy:tiny-llama", "--shape", "tiny-llama", "--threads", "1",
                              "--prefill", "4", "--batches", "1", "--contexts", "4", "--mixed", "",
                              "--reps", "1", "--contend", "1", "--contend-batch", "2",
                              "--contend-ctx", "4", "--kv-cache-bytes", str(4 << 20)]) == 0
    [path] = glob.glob(str(tmp_path / "engine_costs-*.json"))
    doc = json.loads(open(path).read())
    assert doc["config"]["contend"] == 1 and [r["case"] for r in doc["results"]["rows"]] == \
        ["prefill 4", "decode b=1 ctx=4"]


def test_the_result_says_which_decode_attention_the_engine_ran(tmp_path, monkeypatch):
    """cpu_decode_attention: 'native' only where the C kernel serves fp32 decode rows on CPU;
    plan_validate pads the decode rows' contexts (padded_attention auto) for any other CPU result."""
    from types import SimpleNamespace

    from bench import plan_validate
    from engine import cpu_native

    def eng(device="cpu", kernels="auto", dtype="auto"):
        return SimpleNamespace(cfg=SimpleNamespace(device=SimpleNamespace(device=device, cpu_kernels=kernels),
                                                   model=SimpleNamespace(dtype=dtype)))

    monkeypatch.setattr(cpu_native, "library", lambda *a: object())
    assert engine_costs.cpu_decode_attention(eng()) == "native"
    assert engine_costs.cpu_decode_attention(eng(kernels="torch")) == "torch"
    assert engine_costs.cpu_decode_attention(eng(dtype="bf16")) == "torch"
    assert engine_costs.cpu_decode_attention(eng(device="cuda")) is None
    monkeypatch.setattr(cpu_native, "library", lambda *a: None)  # no compiler here
    assert engine_costs.cpu_decode_attention(eng()) == "torch"

    monkeypatch.setenv("SPLITSERVE_BENCH_DIR", str(tmp_path))
    assert engine_costs.main(["--model", "dummy:tiny-llama", "--shape", "tiny-llama", "--threads", "1",
                              "--prefill", "4", "--batches", "1", "--contexts", "4", "--mixed", "",
                              "--reps", "1"]) == 0
    [path] = glob.glob(str(tmp_path / "engine_costs-*.json"))
    assert json.loads(open(path).read())["config"]["cpu_decode_attention"] == "torch"
    assert plan_validate.padded_auto(path)
