"""The GPU kernels compile for sm_90 (tests/engine/kernels/sm90_compile.py, in a subprocess with
the interpreter off): the interpreter never lowers them nor runs their PDL branches."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(scope="module")
def compiled():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the Triton wheel
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tests.engine.kernels.sm90_compile"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_every_variant_compiles(compiled):
    from tests.engine.kernels.sm90_compile import VARIANTS

    assert len(compiled) == len(VARIANTS)
    failed = [(r["kernel"], r["variant"], r.get("error")) for r in compiled if not r["ok"]]
    assert not failed, failed


def test_pdl_instructions_follow_the_pdl_constexpr(compiled):
    for r in compiled:
        pdl = r["variant"].get("PDL")
        if pdl is None:  # a kernel without PDL (prefill attention)
            assert not r["has_wait"] and not r["has_trigger"], r
        elif pdl == 0:
            assert not r["has_wait"] and not r["has_trigger"], r
        else:  # 1 (trigger at the start) or 2 (late): both wait and trigger
            assert r["has_wait"] and r["has_trigger"], r


def test_timestamps_only_when_traced(compiled):
    """engine/kernels/trace.py: TRACE=1 reads %globaltimer; off (the default) compiles it out."""
    traced = [r for r in compiled if r["variant"].get("TRACE")]
    assert len(traced) == 6
    for r in compiled:
        assert r["has_timer"] == bool(r["variant"].get("TRACE")), r
