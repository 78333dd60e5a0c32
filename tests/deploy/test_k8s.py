"""deploy/k8s: every manifest validates against the Kubernetes schemas of a pinned version
(kubernetes-validate, no cluster or kubectl), the kustomization lists exactly the manifests, and
the containers' args are flags the services' own parsers accept, with ports that match the
containers, probes and Services, and the gateway naming the prefill / decode replicas."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (requirements-test.txt)")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSION = "1.30.0"  # NOTE: pinned: grpc probes are GA since 1.27, autoscaling/v2 since 1.23


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _manifests() -> list[str]:
    return sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for f in _manifests() for d in _docs(f) if d["kind"] == kind}


@pytest.mark.parametrize("name", _manifests())
def test_manifest_validates_against_pinned_kubernetes(name):
    for doc in _docs(name):
        kv.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError naming the field


def test_kustomization_lists_every_manifest():
    (k,) = _docs("kustomization.yaml")
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == _manifests()
    images = {i["name"] for i in k["images"]}
    for f in _manifests():
        for d in _docs(f):
            for c in _pod_spec(d).get("containers", []):
                assert c["image"] in images, f"{f}: image {c['image']} not set by the kustomization"


def _pod_spec(doc: dict) -> dict:
    return doc.get("spec", {}).get("template", {}).get("spec", {})


def _container(kind: str, name: str) -> tuple[dict, dict]:
    d = _by_kind(kind)[name]
    (c,) = _pod_spec(d)["containers"]
    return d, c


def _args(c: dict) -> list[str]:
    env = {e["name"]: "pod-0" for e in c.get("env", []) if "valueFrom" in e}
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]  # kubelet's $(VAR)


def _parse(service: str, argv: list[str]):
    if service == "gateway":
        import argparse

        from gateway.config import add_args

        p = argparse.ArgumentParser()
        add_args(p)
        return p.parse_args(argv)
    mod = __import__(f"{service}_svc.__main__", fromlist=["parse_args"])
    return mod.parse_args(argv)


def _ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def _probe_ports(c: dict, ports: dict[str, int]) -> set[int]:
    out = set()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        for how in c[probe].values() if probe in c else ():
            if isinstance(how, dict) and "port" in how:
                out.add(ports.get(how["port"], how["port"]))
    return out


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_replica_flags_and_ports_match(service):
    sts, c = _container("StatefulSet", f"splitserve-{service}")
    argv = _args(c)
    assert argv[0] == service  # the image's ENTRYPOINT is `splitserve`
    a = _parse(service, argv[1:])  # SystemExit on a flag the service does not know
    ports = _ports(c)
    assert (a.port, a.metrics_port) == (ports["grpc"], ports["metrics"])
    assert a.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == a.port, f"{probe} must call grpc.health.v1 on the service"
    tmpl = sts["spec"]["template"]["metadata"]
    assert tmpl["annotations"]["prometheus.io/port"] == str(a.metrics_port)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    svc = _by_kind("Service")[sts["spec"]["serviceName"]]
    assert svc["spec"]["clusterIP"] == "None", "replicas need stable DNS names (headless Service)"
    assert {p["port"] for p in svc["spec"]["ports"]} == {a.port, a.metrics_port}
    assert svc["spec"]["selector"].items() <= tmpl["labels"].items()
    if service == "decode":  # prefill reaches decode's KV endpoint by the pod's own DNS name
        assert a.advertise_address == f"pod-0.{svc['metadata']['name']}:{a.port}"


def test_gateway_flags_ports_and_replica_addresses():
    dep, c = _container("Deployment", "splitserve-gateway")
    argv = _args(c)
    assert argv[0] == "gateway"
    a = _parse("gateway", argv[1:])
    ports = _ports(c)
    assert (a.grpc_port, a.http_port) == (ports["grpc"], ports["http"])
    assert _probe_ports(c, ports) <= {a.grpc_port, a.http_port}
    svc = _by_kind("Service")["splitserve"]
    assert {p["port"] for p in svc["spec"]["ports"]} == {a.grpc_port, a.http_port}
    for role, addrs in (("prefill", a.prefill), ("decode", a.decode)):
        sts = _by_kind("StatefulSet")[f"splitserve-{role}"]
        port = _parse(role, _args(_pod_spec(sts)["containers"][0])[1:]).port
        want = {f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{port}"
                for i in range(sts["spec"]["replicas"])}
        assert {x for s in addrs for x in s.split(",")} == want, f"--{role} must list every replica"


def test_every_service_reads_the_internal_secret_from_the_secret():
    (secret,) = _by_kind("Secret").values()
    for kind, name in (("StatefulSet", "splitserve-prefill"), ("StatefulSet", "splitserve-decode"),
                       ("Deployment", "splitserve-gateway")):
        _, c = _container(kind, name)
        env = {e["name"]: e for e in c["env"]}
        ref = env["SPLITSERVE_INTERNAL_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
        assert _by_kind(kind)[name]["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]


def _render() -> list[dict]:
    """What `kubectl kustomize deploy/k8s` gives for the fields the kustomization uses."""
    import copy

    (k,) = _docs("kustomization.yaml")
    extra = set(k) - {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
    assert not extra, f"the test's render does not apply {extra}: extend _render"
    images = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in k["images"]}
    labels = {n: v for entry in k["labels"] for n, v in entry["pairs"].items()}
    out = []
    for f in k["resources"]:
        for d in _docs(f):
            d = copy.deepcopy(d)
            if d["kind"] != "Namespace":
                d["metadata"]["namespace"] = k["namespace"]
            d["metadata"].setdefault("labels", {}).update(labels)  # no includeSelectors: metadata only
            for c in _pod_spec(d).get("containers", []):
                c["image"] = images.get(c["image"], c["image"])
            out.append(d)
    return out


def test_rendered_base_validates_in_one_namespace():
    docs = _render()
    for d in docs:
        kv.validate(d, K8S_VERSION, strict=True)
    (ns,) = [d for d in docs if d["kind"] == "Namespace"]
    assert {d["metadata"]["namespace"] for d in docs if d is not ns} == {ns["metadata"]["name"]}
    assert all(":" in c["image"] for d in docs for c in _pod_spec(d).get("containers", []))
