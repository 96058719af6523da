"""Rendering helm/radixmesh and validating what it renders, offline.

- `helm`: the binary `make test` installs into the virtual environment (helm/install_helm.py),
  else one on PATH; None when there is none (the tests that need it skip, saying so).
- `render(scenario)`: `helm template` of one named scenario (a values file, maybe with --set),
  parsed into manifests; cached, since every test reads the same few renders.
- `validate(manifest, version)`: Kubernetes kinds against kubernetes-validate's strict schemas of
  that Kubernetes version; RayCluster and ServiceMonitor against the schemas in schemas/, whose
  pod templates and object metadata resolve to the same Kubernetes schemas.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import referencing
import referencing.jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "radixmesh"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE = "radixmesh"
NAMESPACE = "serving"

# name -> helm arguments after the chart. The example files, and the branches they leave out:
# TLS without client certificates (the kubelet's HTTPS readiness probe) and a served name; the
# HTTP API off, with every other optional part on.
SCENARIOS: dict[str, list[str]] = {
    "values": [],
    "values-cpu": ["-f", "values-cpu.yaml"],
    "values-gpu": ["-f", "values-gpu.yaml"],
    "values-multinode-tls": ["-f", "values-multinode-tls.yaml"],
    "values-tls": [
        "--set", "tls.enabled=true,tls.existingSecret=rm-tls,service.httpPort=8443",
        "--set", "config.model.served_name=smollm2-demo",
    ],
    "values-cpu-variants": [
        "-f", "values-cpu.yaml",
        "--set", "config.router.http_port=null",
        "--set", "ray.autoscaling.enabled=true,ray.auth.enabled=false",
        "--set", "auth.enabled=true,auth.tokens.s3cret-acme=acme",
        "--set", "tls.enabled=true,tls.existingSecret=rm-tls,tls.clientAuth=true",
        "--set", "tls.clientCASecret=rm-client-ca,networkPolicy.enabled=true",
        "--set", "metrics.serviceMonitor.enabled=true,model.volume.type=hostPath",
        "--set", "model.volume.hostPath=/srv/models,model.source=smollm2.gguf",
        "--set", "podDisruptionBudget.head.enabled=false,service.port=443",
        "--set", "kvCache.persistence.enabled=true,kvCache.persistence.claimName=rm-kv",
        "--set", "routerState.persistence.enabled=true,routerState.persistence.claimName=rm-state",
        "--set", "metrics.grafanaDashboard.enabled=true",
    ],
}  # fmt: skip


def helm_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "helm"
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which("helm")


HELM = helm_binary()


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run(
        [HELM, *args], cwd=CHART, capture_output=True, text=True, check=check, timeout=60
    )


def template_args(scenario: str) -> list[str]:
    return ["template", RELEASE, ".", "--namespace", NAMESPACE, *SCENARIOS[scenario]]


@functools.cache
def render_text(scenario: str) -> str:
    return run_helm(*template_args(scenario)).stdout


@functools.cache
def render(scenario: str) -> tuple[dict[str, Any], ...]:
    return tuple(doc for doc in yaml.safe_load_all(render_text(scenario)) if doc)


def find(manifests: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    for manifest in manifests:
        if manifest["kind"] == kind and manifest["metadata"]["name"] == name:
            return manifest
    raise KeyError(f"no {kind} {name} in {[(m['kind'], m['metadata']['name']) for m in manifests]}")


# ---- schemas ----------------------------------------------------------------------------------


def kubernetes_schema_dir(version: str) -> Path:
    import kubernetes_validate

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    directory = root / f"v{version}.0-local-strict"
    if not directory.is_dir():
        raise LookupError(f"kubernetes-validate has no schemas for Kubernetes {version}")
    return directory


def kubernetes_versions() -> tuple[str, str]:
    """The chart's minimum Kubernetes (Chart.yaml kubeVersion) and the newest one with schemas."""
    from kubernetes_validate.utils import latest_version

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    minimum = re.match(r">=\s*(\d+\.\d+)", chart["kubeVersion"])
    assert minimum, chart["kubeVersion"]
    newest = ".".join(latest_version().split(".")[:2])
    return minimum.group(1), newest


@functools.cache
def registry(version: str) -> referencing.Registry:
    directory = kubernetes_schema_dir(version)
    resources = [
        referencing.jsonschema.DRAFT202012.create_resource(json.loads(path.read_text()))
        for path in (directory / "_definitions.json", directory / "podtemplatespec-v1.json")
    ]
    return referencing.Registry().with_resources((r.id(), r) for r in resources if r.id())


def kubernetes_schema_file(manifest: dict[str, Any], version: str) -> Path:
    # As kubernetes-validate names them: rbac.authorization.k8s.io/v1 -> rbac-v1.
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", manifest["apiVersion"])
    return kubernetes_schema_dir(version) / f"{manifest['kind'].lower()}-{api}.json"


OWN_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "raycluster-ray.io-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}


@functools.cache
def validator(schema_path: Path, version: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(schema_path.read_text())
    return jsonschema.Draft202012Validator(schema, registry=registry(version))


def schema_path(manifest: dict[str, Any], version: str) -> Path:
    own = OWN_SCHEMAS.get((manifest["apiVersion"], manifest["kind"]))
    path = SCHEMAS / own if own else kubernetes_schema_file(manifest, version)
    if not path.is_file():
        raise LookupError(f"no schema for {manifest['apiVersion']} {manifest['kind']}: {path}")
    return path


def errors(manifest: dict[str, Any], version: str) -> list[str]:
    """Every schema violation of `manifest`, as 'path: message' lines (empty: valid)."""
    check = validator(schema_path(manifest, version), version)
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(check.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    ]
