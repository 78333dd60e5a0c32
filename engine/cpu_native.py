"""The engine's C kernels for CPU (engine/csrc/*.c), compiled on the machine that runs them and
loaded through ctypes: no torch headers, so a build takes about a second with the system's C
compiler. The library is cached under $XDG_CACHE_HOME/splitserve/cpu_kernels (or
~/.cache/...), keyed by the source, the compiler and the CPU's feature flags, and written by an
atomic rename (two services building at once is safe). Without a working compiler the engine
keeps its torch ops; `load()` says why.

It is built with -fopenmp against the soname libgomp.so.1, which the torch wheels ship and load
first: the kernels then run on torch's own OpenMP thread pool (a second runtime would spin its
threads against torch's on a small machine).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("splitserve.engine.cpu_native")

SRC = Path(__file__).parent / "csrc" / "paged_decode_cpu.c"
# tried in order: the fastest first, then the portable ones
# (reassociated float sums let the reductions vectorize: 1.6x on the decode attention)
_MATH = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-ffinite-math-only"]
FLAG_SETS = ([*_MATH, "-march=native", "-fopenmp"], [*_MATH, "-fopenmp"], _MATH)

_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}


def compiler() -> str | None:
    for c in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "splitserve" / "cpu_kernels"


def _build(cc: str, src: Path, out_dir: Path) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    # the headers it may include are part of what is built (a header edit must rebuild)
    parts = [src.read_bytes()] + [h.read_bytes() for h in sorted(src.parent.glob("*.h"))]
    key = hashlib.sha256(b"".join(parts) + version.encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = out_dir / f"{src.stem}-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in FLAG_SETS:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cc, *flags, "-shared", "-fPIC", "-o", tmp, str(src), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        errors.append(f"{' '.join(flags)}: {r.stderr.strip()[-300:]}")
    raise RuntimeError("; ".join(errors))


MODES = ("auto", "native", "torch")


def library(mode: str, src: Path = SRC) -> ctypes.CDLL | None:
    """DeviceConfig.cpu_kernels -> the built library or None: auto = when it builds here,
    native = it must (RuntimeError naming why not), torch = never built."""
    if mode not in MODES:
        raise ValueError(f"cpu_kernels must be one of {MODES}, got {mode!r}")
    if mode == "torch":
        return None
    lib, why = load(src)
    if lib is None and mode == "native":
        raise RuntimeError(f"cpu_kernels=native: {why}")
    return lib


def load(src: Path = SRC) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not). Built once a process (and once a machine, cached)."""
    with _lock:
        if str(src) in _loaded:
            return _loaded[str(src)]
        cc = compiler()
        if cc is None:
            res: tuple = (None, "no C compiler (cc, gcc or clang) on PATH")
        else:
            t0 = time.perf_counter()
            try:
                import torch  # noqa: F401 - torch's libgomp.so.1 is loaded before the kernels

                try:
                    path = _build(cc, src, cache_dir())
                except OSError:  # an unwritable cache: build for this process only
                    path = _build(cc, src, Path(tempfile.mkdtemp(prefix="splitserve-cpu-")))
                res = (ctypes.CDLL(str(path)), "")
                log.info("cpu kernels: %s ready in %.2f s", path.name, time.perf_counter() - t0)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                res = (None, f"build of {src.name} failed: {e}")
        if res[0] is None:
            log.info("cpu kernels: %s; the torch ops serve instead", res[1])
        _loaded[str(src)] = res
        return res
