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
