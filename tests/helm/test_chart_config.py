"""What the chart hands radixmesh: the config file (loaded with radixmesh's own loader), the
render_config.py step that merges the bearer tokens, and the health_check.py probe, run against a
real radixmesh gRPC server and a real radixmesh HTTP API (plaintext, TLS, mutual TLS)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import ClusterConfig, ConfigError, RouterSection, SecuritySection, build
from cluster.http.server import HttpServer, start_http_server
from cluster.policies import build_policy
from cluster.router_service import RouterService
from cluster.worker_links import WorkerLinks
from tests.cluster.certs import make_certificates
from tests.helm import chart
from tests.helm.chart import CHART, NAMESPACE, RELEASE, SCENARIOS, find, render, run_helm
from worker.event_loop import EventLoopThread
from worker.grpc_server import GrpcServer, TlsConfig, start_server

needs_helm = pytest.mark.skipif(
    chart.HELM is None, reason="no helm binary (make test installs one: helm/install_helm.py)"
)
RENDER_CONFIG = CHART / "files" / "render_config.py"
HEALTH_CHECK = CHART / "files" / "health_check.py"
# Keys of radixmesh's config that the chart sets itself (values.schema.json refuses them).
CHART_OWNED = {
    "model": {"source"},
    "engine": {"persist_dir"},
    "workers": {"host"},
    "router": {"host", "resource", "state_dir"},
    "metrics": {"host"},
    "security": {"tls_cert", "tls_key", "tls_client_ca", "auth_tokens"},
}


def load_configmap(scenario: str, tmp_path: Path) -> ClusterConfig:
    text = find(render(scenario), "ConfigMap", RELEASE)["data"]["config.yaml"]
    path = tmp_path / f"{scenario}.yaml"
    path.write_text(text)
    return ClusterConfig.load(path)


@needs_helm
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_configmap_loads_with_radixmesh_loader(scenario: str, tmp_path: Path) -> None:
    config = load_configmap(scenario, tmp_path)
    assert config.router.host == config.workers.host == config.metrics.host == "0.0.0.0"
    assert config.router.resource == "radixmesh-router"
    assert config.security.auth_tokens == {}  # tokens come from their Secret at start


@needs_helm
def test_configmap_values_per_example(tmp_path: Path) -> None:
    cpu = load_configmap("values-cpu", tmp_path)
    assert (cpu.model.source, cpu.model.device, cpu.workers.count) == ("default", "cpu", 2)
    assert (cpu.router.port, cpu.router.policy, cpu.workers.cpus_per_worker) == (
        50051, "cache_aware", 2.0,
    )  # fmt: skip
    assert (cpu.router.http_port, cpu.model.name) == (8000, "SmolLM2-135M-Instruct")
    assert (cpu.security.tls_cert, cpu.security.tls_key) == (None, None)

    gpu = load_configmap("values-gpu", tmp_path)
    assert (gpu.model.device, gpu.model.dtype, gpu.workers.count) == ("cuda", "bfloat16", 8)
    assert (gpu.engine.num_pages, gpu.engine.gpu_memory_utilization) == (None, 0.9)
    assert (gpu.engine.max_model_len, gpu.drain_timeout_s) == (8192, 60.0)

    multi = load_configmap("values-multinode-tls", tmp_path)
    assert multi.workers.count == 16
    assert (multi.metrics.router_port, multi.metrics.worker_port) == (9400, 9401)
    assert multi.model.source == "/models/qwen2.5-14b-instruct-q8_0.gguf"
    assert multi.router.max_message_bytes == 8 << 20
    assert multi.security.tls_cert == "/etc/radixmesh/tls/tls.crt"
    assert multi.security.tls_key == "/etc/radixmesh/tls/tls.key"
    assert multi.security.tls_client_ca == "/etc/radixmesh/tls/ca.crt"

    tls = load_configmap("values-tls", tmp_path)
    assert (tls.router.http_port, tls.model.served_name) == (8000, "smollm2-demo")
    assert tls.security.tls_cert == "/etc/radixmesh/tls/tls.crt"
    assert tls.security.tls_client_ca is None

    variants = load_configmap("values-cpu-variants", tmp_path)
    assert variants.router.http_port is None  # config.router.http_port=null: off, not 8000
    assert variants.model.source == "/models/smollm2.gguf"
    assert variants.security.tls_client_ca == "/etc/radixmesh/client-ca/ca.crt"
    assert variants.engine.persist_dir == "/var/lib/radixmesh/kv"  # kvCache.persistence
    assert cpu.engine.persist_dir is None
    assert variants.router.state_dir == "/var/lib/radixmesh/state"  # routerState.persistence
    assert cpu.router.state_dir is None


@needs_helm
def test_the_saved_kv_cache_lives_on_its_claim_in_every_worker_pod() -> None:
    cluster = find(render("values-cpu-variants"), "RayCluster", RELEASE)
    (group,) = cluster["spec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]
    (claim,) = [v for v in pod["volumes"] if v["name"] == "kv-cache"]
    assert claim["persistentVolumeClaim"] == {"claimName": "rm-kv"}
    mounts = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == "kv-cache"]
    assert [m["mountPath"] for m in mounts] == ["/var/lib/radixmesh/kv"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert all(v["name"] != "kv-cache" for v in head.get("volumes", []))
    off = find(render("values-cpu"), "RayCluster", RELEASE)["spec"]["workerGroupSpecs"][0]
    assert all(v["name"] != "kv-cache" for v in off["template"]["spec"]["volumes"])


@needs_helm
def test_the_router_state_lives_on_its_claim_where_the_router_runs() -> None:
    """The router actor runs in the head pod's Ray container (ray.routerResource): the claim
    is mounted there, in no worker pod."""
    cluster = find(render("values-cpu-variants"), "RayCluster", RELEASE)
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    (claim,) = [v for v in head["volumes"] if v["name"] == "router-state"]
    assert claim["persistentVolumeClaim"] == {"claimName": "rm-state"}
    mounts = {
        c["name"]: [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "router-state"]
        for c in head["containers"]
    }
    assert mounts == {"ray-head": ["/var/lib/radixmesh/state"], "radixmesh-serve": []}
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert all(v["name"] != "router-state" for v in group["template"]["spec"]["volumes"])
    off = find(render("values-cpu"), "RayCluster", RELEASE)["spec"]["headGroupSpec"]
    assert all(v["name"] != "router-state" for v in off["template"]["spec"]["volumes"])


@needs_helm
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_notes_name_the_model_radixmesh_serves(scenario: str, tmp_path: Path) -> None:
    """The model id NOTES.txt tells clients to send is the one radixmesh answers to
    (ModelSection.name), whether set (served_name) or derived from the source."""
    served = load_configmap(scenario, tmp_path).model.name
    result = run_helm(
        "install", RELEASE, ".", "--dry-run=client", "--namespace", NAMESPACE,
        *SCENARIOS[scenario], "--set", "config.router.http_port=8000",
    )  # fmt: skip
    notes = result.stdout.split("NOTES:", 1)[1]
    assert re.findall(r'"model": "([^"]*)"', notes) == [served], served


def test_values_schema_covers_radixmesh_config() -> None:
    """Every radixmesh config key is either settable in values.schema.json or owned by the chart;
    a key added to cluster/config.py fails here until the chart knows it."""
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    sections = schema["properties"]["config"]["properties"]
    for field in fields(ClusterConfig):
        section = sections.get(field.name)
        kind = field.default_factory if callable(field.default_factory) else None  # type: ignore[misc]
        if kind is None:  # a scalar at the top level (drain_timeout_s)
            assert section is not None, f"add config.{field.name} to values.schema.json"
            continue
        known = set(section["properties"]) if section else set()
        owned = CHART_OWNED.get(field.name, set())
        wanted = {f.name for f in fields(kind())} - owned
        assert known == wanted, f"values.schema.json config.{field.name}: {known} != {wanted}"


def test_values_schema_is_as_strict_as_radixmesh() -> None:
    """A value the chart's schema lets through is one radixmesh's loader accepts: every range
    and choice of cluster/config.py is in values.schema.json, or narrower there."""
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())["properties"]["config"]
    sections = [(schema, ClusterConfig)]
    sections += [
        (schema["properties"][f.name], f.default_factory)  # type: ignore[misc]
        for f in fields(ClusterConfig)
        if callable(f.default_factory) and f.name in schema["properties"]  # type: ignore[misc]
    ]
    checked = 0
    for section, kind in sections:
        for f in fields(kind):
            least, most, choices = (f.metadata.get(k) for k in ("least", "most", "choices"))
            if least is None and choices is None:
                continue
            rule, where = section["properties"][f.name], f"config.{f.name}"
            if least is not None:
                floor = _floor(rule)
                assert floor is not None and floor >= least, (where, rule, least)
            if most is not None:
                assert rule.get("maximum", most + 1) <= most, (where, rule, most)
            if choices is not None and "enum" in rule:
                assert set(rule["enum"]) <= set(choices), (where, rule["enum"], choices)
            checked += 1
    assert checked >= 20


def _floor(rule: dict[str, Any]) -> float | None:
    """The least value a schema rule lets through: its minimum, or its branches' least."""
    if "anyOf" in rule:
        floors = [_floor(branch) for branch in rule["anyOf"]]
        return None if None in floors else min(f for f in floors if f is not None)
    if "enum" in rule:
        return min(rule["enum"])
    return rule.get("minimum", rule.get("exclusiveMinimum", rule.get("const")))


# Engine values whose rules tie keys together or are not a range: the chart refuses at install
# exactly those the loader refuses (the schema, or the template's check for block_size).
ENGINE_PROBES = [
    {"page_size": 3}, {"page_size": 24}, {"page_size": 32}, {"page_size": 1},
    {"page_size": 32, "block_size": 64}, {"block_size": 24}, {"block_size": 48},
    {"page_size": 64, "block_size": 32}, {"host_pages": 1}, {"host_pages": 0},
    {"host_pages": 2}, {"num_pages": 1}, {"num_pages": 2},
    {"num_pages": 64, "kv_cache_memory_bytes": 1 << 30}, {"kv_cache_memory_bytes": 1 << 30},
    {"kv_cache_memory_bytes": 0}, {"gpu_memory_utilization": 0}, {"gpu_memory_utilization": 1},
]  # fmt: skip


@needs_helm
@pytest.mark.parametrize(
    "engine",
    ENGINE_PROBES,
    ids=lambda engine: ",".join(f"{key}={value}" for key, value in engine.items()),
)
def test_chart_refuses_the_engine_values_radixmesh_refuses(engine: dict[str, int]) -> None:
    try:
        build(ClusterConfig, {"engine": engine}, "")
        refused = None
    except ConfigError as err:
        refused = str(err)
    sets = [arg for k, v in engine.items() for arg in ("--set", f"config.engine.{k}={v}")]
    result = run_helm("template", RELEASE, ".", *sets, check=False)
    if refused is None:
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode != 0, f"the chart renders {engine}, which radixmesh refuses: {refused}"
    key = refused.split(":")[0].rsplit(".", 1)[-1]
    assert key in result.stderr, (refused, result.stderr)


def test_schema_policy_pattern_accepts_every_policy() -> None:
    from router.policies import POLICIES

    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    pattern = schema["properties"]["config"]["properties"]["router"]["properties"]["policy"]
    assert all(re.fullmatch(pattern["pattern"], name) for name in POLICIES)


# ---- render_config.py -------------------------------------------------------------------------


def run_script(script: Path, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        check=False, capture_output=True, text=True, timeout=60, cwd=chart.REPO,
    )  # fmt: skip


@needs_helm
def test_render_config_merges_tokens_and_checks_the_result(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(
        find(render("values-multinode-tls"), "ConfigMap", RELEASE)["data"]["config.yaml"]
    )
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump({"s3cret-acme": "acme", "s3cret-admin": "*"}))
    out = tmp_path / "rendered" / "config.yaml"
    result = run_script(RENDER_CONFIG, base, out, "--tokens", tokens)
    assert result.returncode == 0, result.stderr
    assert "2 bearer token(s)" in result.stdout and "s3cret" not in result.stdout + result.stderr
    assert (out.stat().st_mode & 0o777) == 0o600
    config = ClusterConfig.load(out)
    assert config.security.auth_tokens == {"s3cret-acme": "acme", "s3cret-admin": "*"}
    assert config.security.tls_cert == "/etc/radixmesh/tls/tls.crt"
    assert config.workers.count == 16


def render_tokens(tmp_path: Path, tokens: str) -> subprocess.CompletedProcess[str]:
    """render_config.py on a plain base config and a Secret's tokens.yaml holding `tokens`."""
    base = tmp_path / "base.yaml"
    base.write_text("router: {port: 50051}\n")
    path = tmp_path / "tokens.yaml"
    path.write_text(tokens)
    return run_script(RENDER_CONFIG, base, tmp_path / "out.yaml", "--tokens", path)


def test_render_config_refuses_bad_tokens_without_printing_them(tmp_path: Path) -> None:
    result = render_tokens(tmp_path, "s3cret-one: 5\n")
    assert result.returncode != 0
    assert "must be a non-empty string" in result.stderr and "s3cret" not in result.stderr


def test_render_config_refuses_a_token_given_twice_without_printing_it(tmp_path: Path) -> None:
    """The last of a repeated key would win: a token bound to one tenant, then to all."""
    result = render_tokens(tmp_path, "s3cret-one: acme\ns3cret-one: '*'\n")
    assert result.returncode != 0
    assert "line 2: a key given twice" in result.stderr and "s3cret" not in result.stderr
    assert not (tmp_path / "out.yaml").exists()


def test_render_config_refuses_what_radixmesh_refuses(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("router: {port: 50051, polcy: cache_aware}\n")
    result = run_script(RENDER_CONFIG, base, tmp_path / "out.yaml")
    assert result.returncode != 0
    assert "radixmesh refuses the config" in result.stderr and "polcy" in result.stderr


# ---- health_check.py against a real server ---------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def serve(certificates: dict[str, Path]) -> Iterator[object]:
    loop = EventLoopThread("health-check-test")
    servers: list[GrpcServer] = []

    def start(tls: TlsConfig | None = None) -> int:
        server = loop.run(start_server([], "127.0.0.1", 0, tls=tls))
        servers.append(server)
        return server.port

    yield start
    for server in servers:
        loop.run(server.stop(0))
    loop.stop()


def test_health_check_plaintext(serve) -> None:  # type: ignore[no-untyped-def]
    port = serve()
    result = run_script(HEALTH_CHECK, "--port", port, "--service", "")
    assert result.returncode == 0, result.stderr
    assert "SERVING" in result.stdout
    unknown = run_script(HEALTH_CHECK, "--port", port, "--service", "radixmesh.v1.Nothing")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_health_check_tls_and_mutual_tls(serve, certificates: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    c = certificates
    port = serve(TlsConfig(c["cert"], c["key"]))
    tls = ["--tls-ca", c["ca"], "--server-name", "localhost"]
    assert run_script(HEALTH_CHECK, "--port", port, *tls).returncode == 0
    plain = run_script(HEALTH_CHECK, "--port", port, "--timeout", "1")
    assert plain.returncode == 1

    mutual = serve(TlsConfig(c["cert"], c["key"], client_ca_file=c["ca"]))
    client = ["--tls-cert", c["client_cert"], "--tls-key", c["client_key"]]
    assert run_script(HEALTH_CHECK, "--port", mutual, *tls, *client).returncode == 0
    no_cert = run_script(HEALTH_CHECK, "--port", mutual, *tls, "--timeout", "1")
    assert no_cert.returncode == 1
    rogue = ["--tls-cert", c["rogue_cert"], "--tls-key", c["rogue_key"], "--timeout", "1"]
    assert run_script(HEALTH_CHECK, "--port", mutual, *tls, *rogue).returncode == 1


# ---- health_check.py --http against the router's real HTTP API --------------------------------


@pytest.fixture
def serve_http() -> Iterator[Callable[[SecuritySection], tuple[int, WorkerLinks]]]:
    """Start radixmesh's HTTP API on a free port with `security`; returns its port and the
    worker links whose count /health reports (none attached: 503)."""
    loop = EventLoopThread("health-check-http-test")
    servers: list[HttpServer] = []

    def start(security: SecuritySection) -> tuple[int, WorkerLinks]:
        config = ClusterConfig(
            router=RouterSection(host="127.0.0.1", port=0, http_port=0), security=security
        )
        links = WorkerLinks(build_policy(config))
        server = loop.run(start_http_server(RouterService(links, config), config))
        assert server is not None
        servers.append(server)
        return server.port, links

    yield start
    for server in servers:
        loop.run(server.stop(0))
    loop.stop()


def test_health_check_http_follows_the_workers(serve_http) -> None:  # type: ignore[no-untyped-def]
    port, links = serve_http(SecuritySection())
    probe = ["--port", port, "--http", "/health", "--timeout", "2"]
    none = run_script(HEALTH_CHECK, *probe)
    assert none.returncode == 1 and "503" in none.stderr and "no healthy worker" in none.stderr
    links.links["worker-0"] = object()  # type: ignore[assignment]  # attached: all /health counts
    ready = run_script(HEALTH_CHECK, *probe)
    assert ready.returncode == 0, ready.stderr
    assert f"http://127.0.0.1:{port}/health: 200" in ready.stdout
    missing = run_script(HEALTH_CHECK, "--port", port, "--http", "/nothing")
    assert missing.returncode == 1 and "404" in missing.stderr


def test_health_check_http_tls_and_mutual_tls(serve_http, certificates: dict[str, Path]) -> None:  # type: ignore[no-untyped-def]
    c = certificates
    tls = ["--tls-ca", c["ca"], "--server-name", "localhost", "--timeout", "2"]
    port, links = serve_http(SecuritySection(tls_cert=str(c["cert"]), tls_key=str(c["key"])))
    links.links["worker-0"] = object()  # type: ignore[assignment]
    assert run_script(HEALTH_CHECK, "--port", port, "--http", "/health", *tls).returncode == 0
    plain = run_script(HEALTH_CHECK, "--port", port, "--http", "/health", "--timeout", "2")
    assert plain.returncode == 1  # HTTPS only
    wrong_name = [*tls[:3], "radixmesh.elsewhere.svc", *tls[4:]]
    assert (
        run_script(HEALTH_CHECK, "--port", port, "--http", "/health", *wrong_name).returncode == 1
    )

    mutual, links = serve_http(
        SecuritySection(tls_cert=str(c["cert"]), tls_key=str(c["key"]), tls_client_ca=str(c["ca"]))
    )
    links.links["worker-0"] = object()  # type: ignore[assignment]
    probe = ["--port", mutual, "--http", "/health", *tls]
    client = ["--tls-cert", c["client_cert"], "--tls-key", c["client_key"]]
    assert run_script(HEALTH_CHECK, *probe, *client).returncode == 0
    # what the kubelet's own HTTPS probe would do: no client certificate, refused
    assert run_script(HEALTH_CHECK, *probe).returncode == 1
    rogue = ["--tls-cert", c["rogue_cert"], "--tls-key", c["rogue_key"]]
    assert run_script(HEALTH_CHECK, *probe, *rogue).returncode == 1


def test_scripts_run_without_radixmesh_on_the_path(tmp_path: Path) -> None:
    """The init container runs render_config.py from the ConfigMap with the image's python: it
    must not lean on the repository checkout (only on the installed package)."""
    base = tmp_path / "base.yaml"
    base.write_text("router: {port: 50051}\n")
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-I", str(RENDER_CONFIG), str(base), str(tmp_path / "o.yaml")],
        check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
