"""helm/radixmesh rendered offline: lint, every manifest against its schema, and what it wires.

Each scenario (tests/helm/chart.py: the default values, the three example files and a variant
that turns on the branches they leave off) is rendered with `helm template` and validated against
the strict Kubernetes schemas of the chart's minimum and the newest Kubernetes, the RayCluster
against KubeRay's fields and the ServiceMonitor against the Prometheus Operator's.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from tests.helm import chart
from tests.helm.chart import CHART, NAMESPACE, RELEASE, SCENARIOS, find, render, run_helm

pytestmark = pytest.mark.skipif(
    chart.HELM is None, reason="no helm binary (make test installs one: helm/install_helm.py)"
)

# The manifests each scenario must render, no more, no fewer (the closing note lists them).
COMMON = [
    ("ConfigMap", "radixmesh"),
    ("Pod", "radixmesh-test-health"),
    ("PodDisruptionBudget", "radixmesh-workers"),
    ("RayCluster", "radixmesh"),
    ("Service", "radixmesh"),
    ("Service", "radixmesh-metrics"),
    ("Service", "radixmesh-worker-metrics"),
]
SMALL = [*COMMON, ("PodDisruptionBudget", "radixmesh-head"), ("Secret", "radixmesh-ray-auth")]
EXPECTED = {
    "values": SMALL,
    "values-cpu": SMALL,
    "values-gpu": SMALL,
    "values-tls": SMALL,
    "values-multinode-tls": [
        *COMMON,
        ("NetworkPolicy", "radixmesh"),
        ("PodDisruptionBudget", "radixmesh-head"),
        ("ServiceMonitor", "radixmesh"),
    ],
    "values-cpu-variants": [
        *COMMON,
        ("ConfigMap", "radixmesh-dashboard"),
        ("NetworkPolicy", "radixmesh"),
        ("Secret", "radixmesh-tokens"),
        ("ServiceMonitor", "radixmesh"),
    ],
}


def head_pod(manifests: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return find(manifests, "RayCluster", RELEASE)["spec"]["headGroupSpec"]["template"]["spec"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name)


def config(manifests: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return yaml.safe_load(find(manifests, "ConfigMap", RELEASE)["data"]["config.yaml"])


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lint_strict(scenario: str) -> None:
    args = [a for a in SCENARIOS[scenario]]
    result = run_helm("lint", "--strict", ".", "--namespace", NAMESPACE, *args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_renders_the_expected_manifests(scenario: str) -> None:
    rendered = sorted((m["kind"], m["metadata"]["name"]) for m in render(scenario))
    assert rendered == sorted(EXPECTED[scenario])


@pytest.mark.parametrize("version", chart.kubernetes_versions())
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_manifest_matches_its_schema(scenario: str, version: str) -> None:
    problems = {
        f"{m['kind']}/{m['metadata']['name']}": chart.errors(m, version) for m in render(scenario)
    }
    assert {name: found for name, found in problems.items() if found} == {}


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (["spec", "workerGroupSpecs", 0, "minReplica"], 1, "'minReplica' was unexpected"),
        (["spec", "headGroupSpec", "rayStartParams", "num-cpus"], 0, "is not of type 'string'"),
        (["spec", "headGroupSpec", "serviceTyp"], "ClusterIP", "'serviceTyp' was unexpected"),
        (["spec", "enableInTreeAutoScaling"], True, "'enableInTreeAutoScaling' was unexpected"),
        (["spec", "headGroupSpec", "template", "spec", "containers", 1, "readinesProbe"], {}, ""),
        (["spec", "workerGroupSpecs", 0, "template", "spec", "tolerations", 0, "efect"], "x", ""),
    ],
)
def test_a_typo_in_the_raycluster_fails(path: list[Any], value: Any, expected: str) -> None:
    raycluster = copy.deepcopy(find(render("values-gpu"), "RayCluster", RELEASE))
    node = raycluster
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    found = chart.errors(raycluster, chart.kubernetes_versions()[0])
    assert found, f"{path} = {value!r} passed the schema"
    assert expected in "\n".join(found)


def test_router_runs_in_the_head_pod_where_the_service_points() -> None:
    manifests = render("values")
    raycluster = find(manifests, "RayCluster", RELEASE)["spec"]
    resources = json.loads(raycluster["headGroupSpec"]["rayStartParams"]["resources"].strip("'"))
    assert resources == {"radixmesh-router": 1}
    assert config(manifests)["router"]["resource"] == "radixmesh-router"
    for group in raycluster["workerGroupSpecs"]:
        assert "resources" not in group["rayStartParams"]
    # The head runs no radixmesh worker: no CPU or GPU for Ray to place one on.
    assert raycluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert raycluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    service = find(manifests, "Service", RELEASE)["spec"]
    assert service["selector"] == {"ray.io/cluster": RELEASE, "ray.io/node-type": "head"}
    ports = {
        p["name"]: p["containerPort"] for p in container(head_pod(manifests), "ray-head")["ports"]
    }
    assert ports["grpc"] == config(manifests)["router"]["port"] == 50051
    assert service["ports"][0]["targetPort"] == "grpc"


@pytest.mark.parametrize(
    ("scenario", "port", "protocol"),
    [
        ("values", 8000, "http"),
        ("values-tls", 8443, "https"),
        ("values-multinode-tls", 443, "https"),
    ],
)
def test_service_serves_http_next_to_grpc(scenario: str, port: int, protocol: str) -> None:
    manifests = render(scenario)
    service = {p["name"]: p for p in find(manifests, "Service", RELEASE)["spec"]["ports"]}
    assert list(service) == ["grpc", "http"]
    assert service["http"] == {
        "name": "http", "port": port, "targetPort": "http", "protocol": "TCP",
        "appProtocol": protocol,
    }  # fmt: skip
    # targetPort http is the router's port, on the container Ray runs the router actor in
    ports = {
        p["name"]: p["containerPort"] for p in container(head_pod(manifests), "ray-head")["ports"]
    }
    assert ports["http"] == config(manifests)["router"]["http_port"] == 8000


def test_http_port_null_turns_the_http_api_off() -> None:
    manifests = render("values-cpu-variants")
    assert config(manifests)["router"]["http_port"] is None  # written: radixmesh's default is 8000
    service = find(manifests, "Service", RELEASE)["spec"]["ports"]
    assert [p["name"] for p in service] == ["grpc"]
    ports = [p["name"] for p in container(head_pod(manifests), "ray-head")["ports"]]
    assert "http" not in ports and "grpc" in ports


@pytest.mark.parametrize("scenario", ["values", "values-gpu"])
def test_native_probes_grpc_for_the_router_http_health_for_readiness(scenario: str) -> None:
    """Startup and liveness ask whether the router is up (gRPC's "", SERVING from start to
    drain, whatever the workers do); readiness asks GET /health, 503 while no worker is
    attached. The port is a number: a probe resolves names among its own container's ports."""
    serve = container(head_pod(render(scenario)), "radixmesh-serve")
    router = config(render(scenario))["router"]
    assert serve["startupProbe"]["grpc"] == {"port": router["port"], "service": ""}
    assert serve["livenessProbe"]["grpc"] == {"port": router["port"], "service": ""}
    assert serve["readinessProbe"]["httpGet"] == {
        "path": "/health", "port": router["http_port"], "scheme": "HTTP",
    }  # fmt: skip
    assert router["http_port"] == 8000
    command = serve["args"][0].rstrip().splitlines()[-1].strip()
    assert command == "exec radixmesh serve --config /etc/radixmesh/config.yaml"


def test_readiness_speaks_https_under_tls() -> None:
    manifests = render("values-tls")
    serve = container(head_pod(manifests), "radixmesh-serve")
    assert serve["readinessProbe"]["httpGet"] == {
        "path": "/health",
        "port": 8000,
        "scheme": "HTTPS",
    }
    # The kubelet's gRPC probe speaks no TLS: startup and liveness stay health_check.py.
    for probe in ("startupProbe", "livenessProbe"):
        command = serve[probe]["exec"]["command"]
        assert command[command.index("--service") + 1] == ""
    assert config(manifests)["security"]["tls_cert"] == "/etc/radixmesh/tls/tls.crt"


def test_without_http_readiness_stays_on_grpc() -> None:
    serve = container(head_pod(render("values-cpu-variants")), "radixmesh-serve")
    command = serve["readinessProbe"]["exec"]["command"]
    assert command[command.index("--service") + 1] == "radixmesh.v1.Serving"
    assert "--http" not in command


def test_tls_probes_run_health_check_with_mounted_files() -> None:
    pod = head_pod(render("values-multinode-tls"))
    serve = container(pod, "radixmesh-serve")
    mounted = {m["mountPath"] for m in serve["volumeMounts"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = serve[probe]["exec"]["command"]
        assert command[:2] == ["python", "/etc/radixmesh/chart/health_check.py"]
        files = [command[i + 1] for i, a in enumerate(command) if a.startswith("--tls-")]
        assert files and all(any(f.startswith(m + "/") for m in mounted) for f in files), files
        assert "--tls-cert" in command  # mutual TLS: the probe presents a client certificate
    # The kubelet's HTTPS probe has no client certificate: readiness asks /health through
    # health_check.py, on the HTTP port.
    readiness = serve["readinessProbe"]["exec"]["command"]
    assert readiness[readiness.index("--http") + 1] == "/health"
    assert readiness[readiness.index("--port") + 1] == "8000"
    # The router (in the ray-head container, where Ray runs its actor) reads the TLS files.
    tls = config(render("values-multinode-tls"))["security"]
    ray_head = {m["mountPath"] for m in container(pod, "ray-head")["volumeMounts"]}
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        assert tls[key].rsplit("/", 1)[0] in ray_head, key


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_mount_has_its_volume(scenario: str) -> None:
    raycluster = find(render(scenario), "RayCluster", RELEASE)["spec"]
    pods = [raycluster["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in raycluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for each in pod["containers"] + pod.get("initContainers", []):
            for mount in each.get("volumeMounts", []):
                assert mount["name"] in volumes, (each["name"], mount)


def test_gpu_workers_ask_for_their_gpus_and_the_model_volume() -> None:
    manifests = render("values-gpu")
    group = find(manifests, "RayCluster", RELEASE)["spec"]["workerGroupSpecs"][0]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 1)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in group[
        "template"
    ]["spec"]["tolerations"]
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    mounts = {m["name"]: m for m in worker["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    cfg = config(manifests)
    assert cfg["model"] | {"dtype": None} == {
        "device": "cuda", "source": "/models/Qwen2.5-7B-Instruct", "dtype": None,
        "weights": "auto", "served_name": "Qwen2.5-7B-Instruct", "adapters": [],
    }  # fmt: skip
    assert cfg["workers"]["count"] == 8
    # The head pod sees no GPU and gets the CUDA image like the workers.
    head = head_pod(manifests)
    assert "nvidia.com/gpu" not in container(head, "ray-head")["resources"]["limits"]
    assert worker["image"] == container(head, "ray-head")["image"]
    assert worker["image"].endswith(":0.1.0-cuda")


def test_every_ray_container_gets_the_ray_token() -> None:
    manifests = render("values-multinode-tls")
    raycluster = find(manifests, "RayCluster", RELEASE)["spec"]
    pods = [raycluster["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in raycluster["workerGroupSpecs"]]
    for pod in pods:
        for each in pod["containers"]:
            env = {e["name"]: e for e in each["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token", each["name"]
            ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "radixmesh-ray-auth", "key": "auth_token"}
    off = head_pod(render("values-cpu-variants"))
    assert {e["name"]: e.get("value") for e in container(off, "ray-head")["env"]} == {
        "RAY_AUTH_MODE": "disabled"
    }


def test_secrets_are_mounted_never_inlined() -> None:
    manifests = render("values-cpu-variants")
    assert "s3cret-acme" not in find(manifests, "ConfigMap", RELEASE)["data"]["config.yaml"]
    tokens = find(manifests, "Secret", "radixmesh-tokens")["data"]["tokens.yaml"]
    init = container(head_pod(manifests), "render-config")
    assert init["command"][-2:] == ["--tokens", "/etc/radixmesh/auth/tokens.yaml"]
    import base64

    assert yaml.safe_load(base64.b64decode(tokens)) == {"s3cret-acme": "acme"}


def test_network_policy_opens_grpc_http_and_metrics_only() -> None:
    policy = find(render("values-multinode-tls"), "NetworkPolicy", RELEASE)["spec"]
    assert policy["podSelector"] == {"matchLabels": {"ray.io/cluster": RELEASE}}
    internal, public_rule, metrics_rule = policy["ingress"]
    assert "ports" not in internal
    assert internal["from"] == [{"podSelector": {"matchLabels": {"ray.io/cluster": RELEASE}}}]
    # the HTTP API is open to whoever may reach gRPC, and only to them
    assert public_rule["ports"] == [
        {"port": 50051, "protocol": "TCP"}, {"port": 8000, "protocol": "TCP"},
    ]  # fmt: skip
    assert public_rule["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "clients"
    }
    assert {"port": 9401, "endPort": 9416, "protocol": "TCP"} in metrics_rule["ports"]
    assert all(p["port"] != 8000 for p in metrics_rule["ports"] + internal.get("ports", []))
    off = find(render("values-cpu-variants"), "NetworkPolicy", RELEASE)["spec"]["ingress"]
    assert off[1]["ports"] == [{"port": 50051, "protocol": "TCP"}]


def test_metrics_services_and_servicemonitor_cover_router_and_every_worker() -> None:
    manifests = render("values-multinode-tls")
    workers = find(manifests, "Service", "radixmesh-worker-metrics")["spec"]
    assert workers["clusterIP"] == "None"
    assert [p["port"] for p in workers["ports"]] == list(range(9401, 9417))
    monitor = find(manifests, "ServiceMonitor", RELEASE)["spec"]
    assert [e["port"] for e in monitor["endpoints"]] == ["router-metrics"] + [
        f"worker-{i}" for i in range(16)
    ]
    labels = monitor["selector"]["matchLabels"]
    for name in ("radixmesh-metrics", "radixmesh-worker-metrics"):
        service_labels = find(manifests, "Service", name)["metadata"]["labels"]
        assert labels.items() <= service_labels.items()


def test_pod_disruption_budgets_select_kuberay_pods() -> None:
    manifests = render("values")
    workers = find(manifests, "PodDisruptionBudget", "radixmesh-workers")["spec"]
    head = find(manifests, "PodDisruptionBudget", "radixmesh-head")["spec"]
    assert workers == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"ray.io/cluster": RELEASE, "ray.io/node-type": "worker"}},
    }
    assert head["minAvailable"] == 1


def test_drain_outlives_serve_and_fits_the_grace_period() -> None:
    manifests = render("values-gpu")
    drain = config(manifests)["drain_timeout_s"]
    pod = head_pod(manifests)
    sleep = int(container(pod, "ray-head")["lifecycle"]["preStop"]["exec"]["command"][1])
    assert drain < sleep < pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["config.router.prot=1"], "additional properties 'prot' not allowed"),
        (["config.router.http_prot=8000"], "additional properties 'http_prot' not allowed"),
        (["config.model.served_nam=smol"], "additional properties 'served_nam' not allowed"),
        (["service.http_port=8000"], "additional properties 'http_port' not allowed"),
        (["config.router.http_port=0"], "/config/router/http_port': minimum"),
        (["config.router.http_port=9400"], "http_port 9400 collides with config.metrics.router"),
        (["config.router.http_port=50051"], "http_port 50051 collides with config.router.port"),
        (["config.router.http_port=8080"], "http_port 8080 collides with Ray's metrics"),
        (["config.router.host=127.0.0.1"], "additional properties 'host' not allowed"),
        (["worker.gpus=-1"], "minimum"),
        (["worker.minReplicas=3"], "need minReplicas (3) <= replicas (2)"),
        (["model.source=llama"], "is a path on the model volume"),
        (["tls.enabled=true"], "tls.enabled needs tls.existingSecret"),
        (["auth.enabled=true"], "auth.enabled needs auth.existingSecret"),
        (["config.workers.cpus_per_worker=4"], "fewer CPUs than the 1 worker(s) of a pod need"),
        (["config.metrics.worker_port=0"], "ports 0 (any free port) cannot be scraped"),
        (["model.volume.type=persistentVolumeClaim,model.source=m"], "needs model.volume.claim"),
        (["routerState.persistence.enabled=true"], "routerState.persistence.claimName"),
        (["config.router.state_dir=/x"], "additional properties 'state_dir' not allowed"),
    ],
)
def test_bad_values_fail_with_a_message(sets: list[str], message: str) -> None:
    args = [arg for item in sets for arg in ("--set", item)]
    result = run_helm("template", RELEASE, ".", *args, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_notes_tell_how_to_reach_generate_and_load_test() -> None:
    result = run_helm(
        "install", RELEASE, ".", "--dry-run=client", "--namespace", NAMESPACE,
        "-f", "values-multinode-tls.yaml",
    )  # fmt: skip
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE} 50051:50051" in notes
    tls = f"--tls-ca ca.crt --tls-server-name {RELEASE}.{NAMESPACE}.svc"
    tls += " --tls-cert client.crt --tls-key client.key"
    target = f"--target 127.0.0.1:50051 {tls} --token $RADIXMESH_TOKEN"
    assert f"radixmesh generate {target}" in notes
    assert f"radixmesh loadtest {target} --workload multi-turn --num-requests 200" in notes
    assert f"helm test {RELEASE}" in notes
    # the HTTP API: forwarded next to gRPC, curl under the certificate's name, with the token
    assert f"port-forward svc/{RELEASE} 50051:50051 8000:443" in notes
    name = f"{RELEASE}.{NAMESPACE}.svc"
    curl = f"curl --cacert ca.crt --connect-to {name}:8000:127.0.0.1:8000"
    curl += f" --cert client.crt --key client.key https://{name}:8000/v1/chat/completions"
    assert f'{curl} -H "Authorization: Bearer $RADIXMESH_TOKEN"' in notes
    assert '"model": "qwen2.5-14b-instruct-q8_0"' in notes


def notes(*args: str) -> str:
    result = run_helm("install", RELEASE, ".", "--dry-run=client", "--namespace", NAMESPACE, *args)
    return result.stdout.split("NOTES:", 1)[1]


def test_notes_show_curl_and_the_model_id() -> None:
    plain = notes()
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE} 50051:50051 8000:8000" in plain
    assert "curl http://127.0.0.1:8000/v1/chat/completions \\\n" in plain
    assert '-d \'{"model": "SmolLM2-135M-Instruct", "messages": [' in plain
    assert "Authorization" not in plain  # no tokens, no header
    tokens = notes("--set", "auth.enabled=true,auth.tokens.s3cret=acme")
    header = '-H "Authorization: Bearer $RADIXMESH_TOKEN"'
    assert f"curl http://127.0.0.1:8000/v1/chat/completions {header}" in tokens
    assert "s3cret" not in tokens
    off = notes("--set", "config.router.http_port=null")
    assert "curl" not in off and "8000" not in off
    assert f"port-forward svc/{RELEASE} 50051:50051\n" in off


def test_chart_files_are_the_ones_in_the_configmap() -> None:
    data = find(render("values"), "ConfigMap", RELEASE)["data"]
    for name in ("render_config.py", "health_check.py"):
        assert data[name] == (CHART / "files" / name).read_text()


def test_the_grafana_dashboard_is_the_chart_file_under_the_sidecar_label() -> None:
    dashboard = find(render("values-cpu-variants"), "ConfigMap", f"{RELEASE}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    text = dashboard["data"]["radixmesh.json"]
    assert text == (CHART / "files" / "grafana-dashboard.json").read_text()
    assert json.loads(text)["uid"] == "radixmesh"
    assert "radixmesh-dashboard" not in {m["metadata"]["name"] for m in render("values")}


def test_serve_shares_rays_sockets_with_the_ray_head() -> None:
    """The driver in radixmesh-serve reaches the head's raylet and object store through the
    sockets under /tmp/ray: one volume, under KubeRay's own name for it (ray-logs)."""
    pod = head_pod(render("values-cpu-variants"))
    for name in ("ray-head", "radixmesh-serve"):
        mounts = {m["mountPath"]: m["name"] for m in container(pod, name)["volumeMounts"]}
        assert mounts["/tmp/ray"] == "ray-logs", name
