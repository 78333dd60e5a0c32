"""Studies: one-off experiments and their raw results (see lab/README.md). Not installed, not
imported by the product. Run from the repository root as `python -m lab.<study>`; results go to
lab/results/ unless SPLITSERVE_BENCH_DIR says otherwise (bench.common.write_result reads it)."""
import os as _os

_os.environ.setdefault("SPLITSERVE_BENCH_DIR", _os.path.join(_os.path.dirname(__file__), "results"))
