"""radixmesh on a real Ray cluster (`ray start --head` on 127.0.0.1): serve, fail, recover.

`radixmesh serve` runs as its own process against the cluster (RAY_ADDRESS), and again through
`ray job submit`. The test process joins the same cluster to find the named actors and kill
them: a killed worker restarts and rejoins the router; a killed router restarts on its port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from cluster.client import Client, text_request
from cluster.ray_runtime import NAMESPACE
from worker.tiny_model import build_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The router knows which worker holds which prefix, and sends the request there. "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(**extra: str) -> dict[str, str]:
    """Loopback only, token authentication on (as `ray start` sets it), our venv first."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


def ray_call(head: dict[str, str], code: str) -> str:
    """Run `code` in a fresh process joined to the cluster (ray reads its auth mode at import);
    `actor(name)` is the named actor; whatever the code prints comes back."""
    prelude = (
        "import ray\n"
        f"ray.init(address={head['address']!r}, namespace={NAMESPACE!r}, logging_level='ERROR')\n"
        "actor = lambda name: ray.get_actor(name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=environment(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return out.stdout.strip()


@pytest.fixture(scope="module")
def head() -> Iterator[dict[str, str]]:
    gcs, dashboard = free_port(), free_port()
    env = environment()
    subprocess.run(
        [
            BIN / "ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=6",
            "--disable-usage-stats",
        ],
        env=env, check=True, timeout=180, capture_output=True,
    )  # fmt: skip
    try:
        yield {"address": f"127.0.0.1:{gcs}", "dashboard": f"http://127.0.0.1:{dashboard}"}
    finally:
        subprocess.run(
            [BIN / "ray", "stop", "--force"], env=env, timeout=120, capture_output=True, check=False
        )


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("ray")
    model = build_tiny_checkpoint(base / "tiny")
    config = {
        "model": {"source": str(model), "device": "cpu"},
        "engine": {"num_pages": 256, "page_size": 4, "max_model_len": 512},
        "workers": {"count": 2},
        "router": {"port": free_port(), "policy": "cache_aware"},
        "metrics": {"router_port": free_port(), "worker_port": free_port()},
        "drain_timeout_s": 10,
    }
    path = base / "radixmesh.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def endpoint(config_file: Path) -> str:
    return f"127.0.0.1:{yaml.safe_load(config_file.read_text())['router']['port']}"


def wait_serving(target: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            last = list(Client(target).generate(text_request("ping", max_tokens=1), timeout=20))[-1]
            if last.finished:
                return
        except grpc.RpcError:
            time.sleep(1)
    raise AssertionError(f"{target} did not serve within {timeout} s")


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout} s")


def test_serve_survives_worker_and_router_deaths(head: dict[str, str], config_file: Path) -> None:
    env = environment(RAY_ADDRESS=head["address"])
    serve = subprocess.Popen(
        [BIN / "radixmesh", "serve", "--config", str(config_file)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    target = endpoint(config_file)
    try:
        line = serve.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == f"radixmesh serving on {target}", line
        client = Client(target)
        first = list(client.generate(text_request(PROMPT + "one", max_tokens=4)))[-1]
        second = list(client.generate(text_request(PROMPT + "two", max_tokens=4)))[-1]
        assert second.worker == first.worker and second.cached_prompt_tokens > 0
        stats = client.stats()
        assert {w.worker for w in stats.workers if w.healthy} == {"worker-0", "worker-1"}

        config = yaml.safe_load(config_file.read_text())["metrics"]
        for port in (config["router_port"], config["worker_port"], config["worker_port"] + 1):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            assert b"radixmesh_" in body
        router_metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{config['router_port']}/metrics", timeout=10
        ).read()
        assert b'radixmesh_router_requests_total{status="OK"}' in router_metrics

        victim_name = first.worker
        describe = f"print(ray.get(actor('radixmesh-{victim_name}').describe.remote())['pid'])"
        pid_before = ray_call(head, describe)
        outcomes: dict[int, object] = {}

        def load(i: int) -> None:
            try:
                stream = list(
                    Client(target).generate(
                        text_request(f"{i} {PROMPT}", max_tokens=80), timeout=120
                    )
                )
                outcomes[i] = stream[-1].finish_reason
            except grpc.RpcError as err:
                outcomes[i] = err.code()

        threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        ray_call(head, f"ray.kill(actor('radixmesh-{victim_name}'), no_restart=False)")
        for thread in threads:
            thread.join(timeout=180)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert set(outcomes) == set(range(6)), outcomes  # no thread died of something else
        assert set(outcomes.values()) <= {"length", grpc.StatusCode.UNAVAILABLE}, outcomes

        def rejoined() -> bool:
            workers = {w.worker: w for w in client.stats().workers}
            return victim_name in workers and workers[victim_name].healthy

        wait_for(rejoined, 180, f"{victim_name} did not rejoin")
        assert ray_call(head, describe) != pid_before, "the worker was not restarted"

        ray_call(head, "ray.kill(actor('radixmesh-router'), no_restart=False)")
        wait_serving(target)
        wait_for(
            lambda: len([w for w in client.stats().workers if w.healthy]) == 2,
            120,
            "workers did not return to the restarted router",
        )
        assert list(client.generate(text_request(PROMPT, max_tokens=3)))[-1].finished
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            serve.kill()
            raise
        stderr = serve.stderr.read()  # type: ignore[union-attr]
    assert code == 0, stderr[-3000:]
    assert "draining" in stderr and "stopped" in stderr


def test_ray_job_submit_runs_the_same_command(head: dict[str, str], config_file: Path) -> None:
    env = environment()
    job = f"radixmesh-test-{os.getpid()}"
    submit = [
        BIN / "ray", "job", "submit", "--address", head["dashboard"], "--submission-id", job,
        "--working-dir", str(ROOT), "--no-wait", "--",
        "radixmesh", "serve", "--config", str(config_file),
    ]  # fmt: skip
    subprocess.run(submit, env=env, check=True, timeout=180, capture_output=True)
    target = endpoint(config_file)
    try:
        wait_serving(target)
        answer = list(Client(target).generate(text_request(PROMPT, max_tokens=5)))[-1]
        assert answer.finished and answer.worker.startswith("worker-")
    finally:
        subprocess.run(
            [BIN / "ray", "job", "stop", "--address", head["dashboard"], job],
            env=env, timeout=180, capture_output=True, check=False,
        )  # fmt: skip
    status = subprocess.run(
        [BIN / "ray", "job", "status", "--address", head["dashboard"], job],
        env=env, timeout=60, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "stopped" in status.stdout.lower() or "succeeded" in status.stdout.lower(), status.stdout
