"""Generate the python stubs for protos/splitserve/**.proto into protos/gen/ (gitignored).

Run `python protos/build.py` to force a rebuild; importing
`protos` runs it on demand when the stubs are missing or older than any .proto file.

NOTE: generated modules import each other as `splitserve.v1...`, so protos/gen/ must be on
sys.path (protos/__init__.py puts it there). Stubs are never edited by hand.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
GEN_DIR = PROTO_ROOT / "gen"
STAMP = GEN_DIR / ".stamp"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.joinpath("splitserve").rglob("*.proto"))


def is_stale() -> bool:
    """True when the stubs are missing or older than any .proto (or build.py itself)."""
    if not STAMP.exists():
        return True
    built = STAMP.stat().st_mtime
    sources = proto_files() + [Path(__file__).resolve()]
    return any(p.stat().st_mtime > built for p in sources)


def _run_protoc(out_dir: Path) -> None:
    from grpc_tools import protoc  # imported lazily: only needed when building
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")  # google/protobuf/*.proto
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
            f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *files]
    # protoc resolves -I paths relative to cwd; absolute paths make cwd irrelevant.
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed (exit {rc}) for {files}")
    # Namespace-free packages: add __init__.py so `splitserve.v1` imports as a regular package.
    for d in [out_dir, *[p for p in out_dir.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()


def build(force: bool = False) -> Path:
    """Generate stubs if stale (or force). Safe against concurrent builders (file lock +
    build into a temp dir, then swap in)."""
    # Lock outside the tree (nothing untracked in git status); keyed by the checkout path.
    lock_path = Path(tempfile.gettempdir()) / f"splitserve-protos-{zlib.crc32(str(PROTO_ROOT).encode()):08x}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not force and not is_stale():
                return GEN_DIR
            tmp = Path(tempfile.mkdtemp(prefix="gen.", dir=PROTO_ROOT))
            try:
                _run_protoc(tmp)
                (tmp / ".stamp").touch()
                old = None
                if GEN_DIR.exists():
                    old = PROTO_ROOT / f".gen.old.{os.getpid()}"
                    GEN_DIR.rename(old)
                tmp.rename(GEN_DIR)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return GEN_DIR


if __name__ == "__main__":
    out = build(force=True)
    print(f"generated stubs in {out}")
