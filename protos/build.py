"""Generate the python stubs for protos/splitserve/**.proto.

Where the stubs live:
- a built wheel (`pip install .`) carries them in protos/gen/, generated at build time by
  `BuildPy` (pyproject.toml's cmdclass) with the build's grpcio-tools;
- a source checkout generates them into protos/gen/ (gitignored) on first import;
- where protos/gen/ is missing or stale and cannot be written (a read-only site-packages), they
  are generated into the user cache: $XDG_CACHE_HOME/splitserve/protos-<hash> (~/.cache/...).

Stale means: protos/gen/.stamp does not hold the hash of the .proto sources and this file.
Run `python protos/build.py` to force a rebuild of protos/gen/.

NOTE: generated modules import each other as `splitserve.v1...`, so the stub directory must be
on sys.path (protos/__init__.py puts it there). Stubs are never edited by hand.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
import zlib
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
GEN_DIR = PROTO_ROOT / "gen"
STAMP_NAME = ".stamp"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.joinpath("splitserve").rglob("*.proto"))


def source_hash() -> str:
    """sha256 over the .proto files (path and content) and this file."""
    h = hashlib.sha256()
    for p in proto_files():
        h.update(str(p.relative_to(PROTO_ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(Path(__file__).resolve().read_bytes())
    return h.hexdigest()


def is_stale(gen_dir: Path = GEN_DIR) -> bool:
    """True when the stubs in gen_dir are missing or were built from other sources."""
    stamp = gen_dir / STAMP_NAME
    try:
        return stamp.read_text().strip() != source_hash()
    except OSError:
        return True


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "splitserve" / f"protos-{source_hash()[:16]}"


def generate(out_dir: Path) -> None:
    """Run protoc (grpcio-tools) for every .proto into out_dir, which must exist."""
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
    (out_dir / STAMP_NAME).write_text(source_hash() + "\n")


def _build_into(gen_dir: Path, force: bool) -> Path:
    """Generate into gen_dir unless fresh (or force). Safe against concurrent builders (file
    lock + build into a temp dir beside it, then swap in). Raises OSError when gen_dir's
    parent cannot be written."""
    lock_path = Path(tempfile.gettempdir()) / f"splitserve-protos-{zlib.crc32(str(gen_dir).encode()):08x}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not force and not is_stale(gen_dir):
                _refresh_stamp(gen_dir)
                return gen_dir
            gen_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix="gen.", dir=gen_dir.parent))
            try:
                generate(tmp)
                old = None
                if gen_dir.exists():
                    old = gen_dir.parent / f".{gen_dir.name}.old.{os.getpid()}"
                    gen_dir.rename(old)
                tmp.rename(gen_dir)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return gen_dir


def _refresh_stamp(gen_dir: Path) -> None:
    """A source touched without a change keeps its stubs; the stamp is made newer than it
    again (best effort: a read-only install keeps its stamp)."""
    stamp = gen_dir / STAMP_NAME
    try:
        built = stamp.stat().st_mtime
        if any(p.stat().st_mtime > built for p in proto_files()):
            os.utime(stamp)
    except OSError:
        pass


def build(force: bool = False) -> Path:
    """-> a directory holding fresh stubs: protos/gen/ (generated there when stale and
    writable), else the user cache directory."""
    if not force and not is_stale(GEN_DIR):
        _refresh_stamp(GEN_DIR)
        return GEN_DIR
    try:
        return _build_into(GEN_DIR, force)
    except OSError:  # read-only install: the user cache
        return _build_into(cache_dir(), force)


def rebuild_in_cache() -> Path:
    """Stubs generated by the grpcio-tools installed now, in the user cache (used when the
    packaged stubs do not import with this grpcio / protobuf)."""
    return _build_into(cache_dir(), force=True)


def _make_build_py():
    """setuptools build_py that also writes the stubs into the wheel's protos/gen/."""
    from setuptools.command.build_py import build_py

    class BuildPy(build_py):
        def run(self):
            super().run()
            if getattr(self, "editable_mode", False):
                return  # editable installs generate into the checkout on first import
            out = Path(self.build_lib) / "protos" / "gen"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            generate(out)

    return BuildPy


def __getattr__(name: str):
    # NOTE: setuptools is imported only by a build, never when the stubs are imported
    if name == "BuildPy":
        return _make_build_py()
    raise AttributeError(name)


if __name__ == "__main__":
    out = _build_into(GEN_DIR, force=True)
    print(f"generated stubs in {out}")
