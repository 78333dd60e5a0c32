"""bench.engine_gpu's median over graph re-captures, on a stand-in engine (timing needs a GPU)."""
from types import SimpleNamespace

import bench.engine_gpu as eg


def test_recaptured_takes_the_median_over_captures(monkeypatch):
    captures = []
    runner = SimpleNamespace(graphs=object(), model=SimpleNamespace(attn_backend=SimpleNamespace(name="triton")),
                             maybe_capture_graphs=lambda max_len, backend: captures.append((max_len, backend)))
    eng = SimpleNamespace(runner=runner)
    # (1, 1024), (64, 2048) after capture 1, then after capture 2: (graph_ms, replay_ms)
    times = iter([(4.3, 4.0), (9.9, 9.0), (4.0, 3.95), (9.5, 9.1)])
    monkeypatch.setattr(eg, "time_decode", lambda e, b, c, eager=True: dict(
        zip(("graph_ms", "replay_ms"), next(times))))
    rows = [{"shape": "s", "case": "decode b=1 ctx=1024", "graph_ms": 4.1, "replay_ms": 3.9},
            {"shape": "s", "case": "decode b=64 ctx=2048", "graph_ms": 9.7, "replay_ms": 8.9}]
    out = eg._recaptured(eng, "s", [(1, 1024), (64, 2048)], rows, 2, 2048)
    assert captures == [(2112, "triton")] * 2
    assert [(r["case"], r["graph_ms"], r["samples"], r["replay_ms"], r["replay_samples"])
            for r in out] == [
        ("decode b=1 ctx=1024 median of 3 captures", 4.1, [4.1, 4.3, 4.0], 3.95, [3.9, 4.0, 3.95]),
        ("decode b=64 ctx=2048 median of 3 captures", 9.7, [9.7, 9.9, 9.5], 9.0, [8.9, 9.0, 9.1])]
    assert eg._recaptured(eng, "s", [(1, 1024)], rows, 0, 2048) == []  # --recaptures 0


def test_serving_loop_times_both_modes_and_restores_the_switch():
    from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
    from engine.engine import Engine

    eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                              cache=CacheConfig(block_size=16, num_blocks=64), device=DeviceConfig(device="cpu")))
    out = eg._serving_loop(eng, "tiny", [(2, 20)], steps=10)  # an arrival every 8 steps
    assert [r["case"] for r in out] == ["serving loop b=2 ctx=20"]
    assert out[0]["sync_ms"] > 0 and out[0]["tpot_ms"] > 0
    assert out[0]["arrivals_sync_tok_s"] > 0 and out[0]["arrivals_tok_s"] > 0
    assert out[0]["arrivals_mixed_steps"] >= 1 and out[0]["arrivals_blind_steps"] >= 1
    assert eng.overlap is False and eng.num_overlapped_steps >= 3 and not eng.has_unfinished()
