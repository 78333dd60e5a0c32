"""bench/decode_loop.py's engine-loop measurement on a tiny CPU engine (the graph timings need
a GPU): a real generation, per-step phases recorded, the wrapped methods restored."""
import pytest

torch = pytest.importorskip("torch")

from bench.decode_loop import _engine_loop  # noqa: E402
from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402


def test_engine_loop_phases():
    eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                              cache=CacheConfig(block_size=16, num_blocks=64),
                              device=DeviceConfig(device="cpu")))
    execute = eng.runner.execute
    got = _engine_loop(eng, batch=2, ctx=20, steps=6)
    assert got["engine_steps"] == 6 and got["engine_ms"] > 0
    for phase in ("schedule", "sampling_batch", "execute", "sample_launch", "update"):
        assert got[f"{phase}_us"] > 0
    assert "run_rows_us" not in got  # no graphs on CPU
    assert eng.runner.execute == execute and not eng.has_unfinished()
    eng.overlap = True  # the overlapped loop (on CPU nothing overlaps, the logic runs)
    again = _engine_loop(eng, batch=2, ctx=20, steps=6, tag="again")
    assert again["engine_steps"] == 6 and eng.num_overlapped_steps >= 4



def test_arrivals_loop_steady_state():
    """arrivals_loop: requests end and new prompts arrive in their place; the mixed steps are
    counted, the overlapped engine launches blind steps (mixed ones included), and the engine
    is left empty with the runner's launch methods restored."""
    from bench.decode_loop import arrivals_loop

    eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                              cache=CacheConfig(block_size=16, num_blocks=64),
                              device=DeviceConfig(device="cpu")))
    launch = (eng.runner.execute, eng.runner.launch_overlapped)
    res = {}
    for on in (False, True):
        eng.overlap = on
        res[on] = arrivals_loop(eng, batch=3, ctx=20, steps=24, every=4, prompt_len=9, tag=f"a{on}")
        assert not eng.has_unfinished() and (eng.runner.execute, eng.runner.launch_overlapped) == launch
    assert res[False]["arr_mixed"] >= 4 and res[False]["arr_blind"] == 0
    assert res[True]["arr_blind"] >= 8 and res[True]["arr_tok_s"] > 0


def test_arrivals_loop_first_requests_end_during_prefill():
    """With prompts chunked over many steps, the first requests end (by length) while later
    prompts are still in prefill: they are replaced, not looked up after they left (a KeyError
    at 8B batch 64, ctx 2048 on the H200)."""
    from bench.decode_loop import arrivals_loop
    from engine.config import SchedulerConfig

    eng = Engine(EngineConfig(model=ModelConfig("dummy:tiny-llama", dtype="fp32", max_model_len=128),
                              cache=CacheConfig(block_size=16, num_blocks=64),
                              scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8),
                              device=DeviceConfig(device="cpu")))
    got = arrivals_loop(eng, batch=6, ctx=20, steps=8, every=2, prompt_len=5, tag="early")
    assert got["arr_tok_s"] > 0 and not eng.has_unfinished()
