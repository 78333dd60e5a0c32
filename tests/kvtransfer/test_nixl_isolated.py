"""Runs test_nixl_real.py in its own pytest process: UCX is loaded there, so a native abort
in it fails this test with its output instead of ending the whole suite."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.kvtransfer.nixl_child import CHILD_ENV

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.timeout(600)
def test_real_nixl_in_its_own_process(request):
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
            os.path.join(HERE, "test_nixl_real.py")]
    marks = request.config.getoption("markexpr")
    if marks:
        args += ["-m", marks]
    r = subprocess.run(args, cwd=ROOT, env={**os.environ, CHILD_ENV: "1"},
                       capture_output=True, text=True, timeout=560)
    out = r.stdout[-4000:] + r.stderr[-2000:]
    print(out)
    assert r.returncode in (0, 5), f"exit {r.returncode}:\n{out}"
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    if "passed" not in summary:
        m = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", r.stdout)
        pytest.skip(m.group(1) if m else f"nothing ran: {summary}")
