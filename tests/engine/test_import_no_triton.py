"""The engine's CPU import path must not import triton: the kernel tests set TRITON_INTERPRET
when they are collected, after the engine modules were imported by earlier tests, and a
triton imported before that runs every later kernel test compiled instead of interpreted
(it failed the whole kernel suite once, via engine/kernels/common.py)."""
import subprocess
import sys


def test_engine_imports_without_triton():
    code = ("import sys, engine.engine, engine.models.llama, engine.runner, engine.kernels.common; "
            "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.')]; "
            "assert not bad, bad[:5]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
