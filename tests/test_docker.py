"""docker/: compose.yaml is valid Compose (`docker compose config` where the plugin is
installed, else the Compose Specification's models from compose-pydantic), every file it mounts
or builds from exists, Prometheus scrapes the ports the services serve /metrics on, Grafana
gets its data source and dashboard; the CUDA image can compile Triton's launcher (a C compiler
and Python headers), the CPU image installs no Triton."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from compose_pydantic.models import ComposeSpecification
from dockerfile_parse import DockerfileParser

DOCKER = Path(__file__).resolve().parents[1] / "docker"
ROOT = DOCKER.parent
COMPOSE = DOCKER / "compose.yaml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _no_extensions(x):
    """The spec allows `x-*` keys anywhere (patternProperties); the generated models do not."""
    if isinstance(x, dict):
        return {k: _no_extensions(v) for k, v in x.items() if not str(k).startswith("x-")}
    if isinstance(x, list):
        return [_no_extensions(v) for v in x]
    return x


def _has_compose_v2() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


def test_compose_matches_the_compose_specification():
    d = _compose()
    assert "version" not in d, "`version` is obsolete in Compose v2 (it warns and ignores it)"
    spec = ComposeSpecification.model_validate(_no_extensions(d))
    assert {"prefill", "decode", "gateway", "prometheus", "grafana", "jaeger"} <= set(spec.services)
    bad = _no_extensions(d)
    bad["services"]["gateway"]["links_v1"] = ["prefill"]  # the check does reject an unknown key
    with pytest.raises(ValueError):
        ComposeSpecification.model_validate(bad)


@pytest.mark.skipif(not _has_compose_v2(), reason="no `docker compose` (Compose v2) on this machine")
def test_docker_compose_config():
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "obsolete" not in r.stderr, r.stderr


def test_compose_files_exist_and_metrics_ports_are_scraped():
    d = _compose()
    svcs = d["services"]
    for name, svc in svcs.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            assert (DOCKER / src).exists(), f"{name} mounts {src}, which is not in docker/"
        build = svc.get("build")
        if build:  # the default Dockerfile (no variable set)
            dockerfile = build["dockerfile"].replace("${SPLITSERVE_DOCKERFILE:-Dockerfile.cpu}",
                                                     "Dockerfile.cpu")
            assert (DOCKER / build["context"] / dockerfile).resolve().is_file(), dockerfile
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name in ("prefill", "decode"):
        cmd = svcs[name]["command"]
        port = cmd[cmd.index("--metrics-port") + 1]
        assert f"{name}:{port}" in targets and port in svcs[name]["expose"]
    gw = svcs["gateway"]["command"]
    assert f"gateway:{gw[gw.index('--http-port') + 1]}" in targets  # the gateway's REST /metrics


def test_grafana_is_provisioned():
    g = _compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in g["volumes"])
    prov = DOCKER / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [x["url"] for x in ds if x["type"] == "prometheus"] == ["http://prometheus:9090"]
    provider = yaml.safe_load((prov / "dashboards" / "splitserve.yml").read_text())["providers"][0]
    in_container = provider["options"]["path"]
    host_dir = next(DOCKER / src for src, dst in mounts.items() if dst == in_container)
    dashboards = list(host_dir.glob("*.json"))
    assert dashboards, f"no dashboard in {host_dir}"
    for f in dashboards:
        assert json.loads(f.read_text())["panels"]
    home = g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(in_container) and (host_dir / Path(home).name).is_file()


def _parse(name: str) -> DockerfileParser:
    # NOTE: fileobj: given a path, the parser takes a name not ending in "Dockerfile" for a folder
    return DockerfileParser(fileobj=io.BytesIO((DOCKER / name).read_bytes()))


def _runs(df: DockerfileParser) -> str:
    return "\n".join(i["value"] for i in df.structure if i["instruction"] == "RUN")


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_copies_what_exists(name):
    df = _parse(name)
    for ins in df.structure:
        if ins["instruction"] == "COPY":
            for src in ins["value"].split()[:-1]:
                assert (ROOT / src).exists(), f"{name}: COPY {src}: not in the repository"
    assert (DOCKER / f"{name}.dockerignore").is_file()  # BuildKit's per-Dockerfile ignore file


def test_cuda_image_can_compile_triton_launchers():
    df = _parse("Dockerfile")
    runs = _runs(df)
    devel = "-devel" in df.baseimage
    assert devel or ("gcc" in runs and "python3-dev" in runs), "Triton needs a C compiler and Python.h"
    assert ".[gpu]" in runs  # Triton itself


def test_cpu_image_has_no_triton():
    df = _parse("Dockerfile.cpu")
    runs = _runs(df)
    assert "nvidia" not in df.baseimage and "[gpu]" not in runs and "triton" not in runs.replace(
        "find_spec('triton')", "")
    assert df.args["TORCH_INDEX_URL"].endswith("/cpu")


def test_dashboard_gateway_job_is_the_prometheus_job():
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    gw_job = next(j["job_name"] for j in prom["scrape_configs"]
                  if any(t.startswith("gateway:") for sc in j["static_configs"] for t in sc["targets"]))
    dash = json.loads((DOCKER / "grafana" / "dashboards" / "splitserve.json").read_text())
    var = next(v for v in dash["templating"]["list"] if v["name"] == "gateway_job")
    assert var["current"]["value"] == var["query"] == gw_job
