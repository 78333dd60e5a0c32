"""`splitserve bench ...`: the serving benchmark (bench/serve.py; same flags as
`python -m bench.serve`, `splitserve bench --help` lists them). bench/ lives in the source
checkout beside this package; it is not installed with it."""
from __future__ import annotations

import os
import sys


def run(argv: list[str]) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.exists(os.path.join(root, "bench", "serve.py")) and root not in sys.path:
        sys.path.insert(0, root)
    try:
        from bench import serve
    except ImportError as e:
        print(f"splitserve bench: the benchmark needs the source checkout (bench/) and its "
              f"test requirements (requirements-test.txt): {e}", file=sys.stderr)
        return 2
    return serve.main(argv)
