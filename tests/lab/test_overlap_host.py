"""lab/overlap_host.py on a tiny CPU engine: the planning and building of blind steps is timed
per step, every decode step after the first is blind, and the engine's functions are restored."""
import engine.engine as engine_mod
from lab.overlap_host import measure


def test_measure_times_plan_and_follow_and_restores_them():
    plan, follow = engine_mod.plan_follow, engine_mod.follow
    got = measure(batch=3, steps=6, device="cpu")
    assert got["plan_us"] > 0 and got["follow_us"] > 0 and got["step_wall_ms"] > 0
    assert got["blind_steps"] >= got["steps"] - 2
    assert (engine_mod.plan_follow, engine_mod.follow) == (plan, follow)
