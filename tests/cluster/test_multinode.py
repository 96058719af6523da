"""radixmesh on two Ray nodes, and losing one of them mid-load.

Two network namespaces joined by a veth pair (tests/cluster/netns.py) are two machines: a Ray
head in A (its only addresses: A's loopback and A's end of the veth), a Ray worker node in B.
`radixmesh serve` runs unchanged in A against the head; every node offers one CPU, so its two
workers land one per node, and the router (no CPU) is pinned to the head by a custom resource.
Clients run in A and reach the router on A's loopback; the router reaches the worker on B over
the veth. Nothing of the test listens in the root namespace.

Then every process of node B is killed (SIGKILL, `ip netns pids`) while streams run on both
workers: the streams on B must migrate to A with no error seen by their clients, and complete.
Ray marks B dead; B is started again (same address, a new node); Ray restarts B's worker there
(it cannot go to the head: its one CPU is taken) and the router attaches it again.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.ray_runtime import NAMESPACE
from cluster.ray_token import create_token_file, token_environment
from tests.cluster import netns
from worker.tiny_model import build_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
GCS_PORT = 6379  # any port: the namespaces are new and empty
ROUTER_PORT = 50051
HEAD_RESOURCE = "radixmesh_head"
STREAMS = 8
MAX_TOKENS = 480
KILL_AFTER = 48
"""Node B dies once every stream has received this many tokens (of MAX_TOKENS)."""
PROMPT = "The router knows which worker holds which prefix, and sends the request there."

HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
"""The GCS (on the head) marks a node dead after 3 failed health checks 1 s apart, instead of
Ray's default 5 x 3 s (plus a 10 s timeout each): a dead node B is seen in about 3-5 s."""

# Runs in namespace A: `count` concurrent greedy requests of `max_tokens` tokens (ignore_eos), one
# JSON line per event: "running" once a stream has `mark` tokens (and the worker serving it), "done"
# at its end or its error (with the workers that served it, in order).
CLIENT = r"""
import json, sys, threading, time
import grpc
from cluster.client import Client, text_request

target, count, max_tokens, mark, tag, prompt = sys.argv[1:7]
count, max_tokens, mark = int(count), int(max_tokens), int(mark)
lock = threading.Lock()

def emit(**record):
    with lock:
        print(json.dumps({**record, "t": time.time()}), flush=True)

def run(i):
    request = text_request(f"{i} {tag} {prompt}", max_tokens=max_tokens, temperature=0.0,
                           request_id=f"{tag}-{i}")
    request.sampling.ignore_eos = True
    tokens, workers, last = 0, [], None
    try:
        for response in Client(target).generate(request, timeout=150):
            if response.worker and (not workers or workers[-1] != response.worker):
                workers.append(response.worker)
            if tokens < mark <= tokens + len(response.token_ids):
                emit(event="running", i=i, worker=response.worker)
            tokens += len(response.token_ids)
            last = response
        emit(event="done", i=i, tokens=tokens, workers=workers, error=None,
             finish_reason=last.finish_reason if last else "")
    except grpc.RpcError as err:
        emit(event="done", i=i, tokens=tokens, workers=workers, error=err.code().name,
             details=err.details())

threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""

STATS = r"""
import json, sys
from cluster.client import Client
stats = Client(sys.argv[1]).stats(timeout=10)
print(json.dumps({w.worker: {"healthy": w.healthy, "address": w.address} for w in stats.workers}))
"""


class Lines:
    """A process's stdout, line by line, read on a thread: waits that can time out."""

    def __init__(self, stream: Any) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next(self, timeout: float) -> str | None:
        """The next line (None at the end of the stream); raises queue.Empty after `timeout`."""
        return self.lines.get(timeout=timeout)


@dataclass
class TwoNodes:
    a: netns.Namespace
    b: netns.Namespace
    tmp: Path
    token: Path
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def gcs(self) -> str:
        return f"{self.a.address}:{GCS_PORT}"

    def environment(self, **extra: str) -> dict[str, str]:
        """Token authentication on, no proxy, our venv first, a home and a TMPDIR of our own."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("RAY_") and not k.lower().endswith("_proxy")
        }
        env.update(
            PATH=f"{BIN}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}",
            HOME=str(self.tmp / "home"),
            TMPDIR=str(self.tmp),  # what the actors leave in a temporary directory goes with it
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
            RAY_USAGE_STATS_ENABLED="0",
            OMP_WAIT_POLICY="PASSIVE",
            PYTHONPATH=str(ROOT),  # this tree's code, in every process (Ray's workers included)
            **token_environment(self.token),
        )
        env.update(extra)
        return env

    def run(
        self, ns: netns.Namespace, argv: list[Any], timeout: float = 120, **env: str
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ns.command(argv), env=self.environment(**env), cwd=ROOT,
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise AssertionError(f"{argv[:3]} in {ns.name}: exit {out.returncode}\n{out.stderr}")
        return out

    def start_head(self) -> None:
        self.run(
            self.a,
            [
                BIN / "ray", "start", "--head", f"--node-ip-address={self.a.address}",
                f"--port={GCS_PORT}", "--num-cpus=1", f"--resources={{\"{HEAD_RESOURCE}\": 1}}",
                "--include-dashboard=false", "--disable-usage-stats",
                f"--temp-dir={self.tmp / 'ray-a'}",
            ],
            timeout=180,
            **HEALTH_CHECKS,
        )  # fmt: skip

    def start_node_b(self, incarnation: int) -> None:
        # `ray start --address` refuses to join a cluster in RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
        # (it means "no multi-node clusters"); B's only interfaces are lo and the veth anyway.
        self.run(
            self.b,
            [
                BIN / "ray", "start", f"--address={self.gcs}",
                f"--node-ip-address={self.b.address}", "--num-cpus=1", "--disable-usage-stats",
                f"--temp-dir={self.tmp / f'ray-b{incarnation}'}",
            ],
            timeout=180,
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",
        )  # fmt: skip

    def ray(self, code: str, timeout: float = 120) -> Any:
        """`code` in a fresh driver in A joined to the cluster; the JSON it prints."""
        prelude = (
            "import json, os, time\nimport ray\n"
            f"ray.init(address={self.gcs!r}, namespace={NAMESPACE!r}, logging_level='ERROR')\n"
        )
        out = self.run(self.a, [sys.executable, "-c", prelude + code], timeout=timeout)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stats(self) -> dict[str, dict[str, Any]]:
        """The router's view of its workers, asked from inside A."""
        out = self.run(self.a, [sys.executable, "-c", STATS, f"127.0.0.1:{ROUTER_PORT}"])
        return dict(json.loads(out.stdout))

    def load(
        self, count: int, max_tokens: int, mark: int, tag: str
    ) -> tuple[subprocess.Popen[str], Lines]:
        proc = subprocess.Popen(
            self.a.command(
                [sys.executable, "-c", CLIENT, f"127.0.0.1:{ROUTER_PORT}", count, max_tokens,
                 mark, tag, PROMPT]
            ),
            env=self.environment(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc, Lines(proc.stdout)


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[TwoNodes]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"two network namespaces cannot be made here: {reason}")
    # short: Ray's unix sockets live under it and their paths are limited to 107 bytes
    tmp = Path(tempfile.mkdtemp(prefix=f"rmn{os.getpid()}-", dir="/tmp"))
    (tmp / "home").mkdir()
    try:
        with netns.joined_namespaces() as (a, b):
            nodes = TwoNodes(a, b, tmp, create_token_file(tmp / "ray_token"))
            try:
                yield nodes
            finally:
                for proc in nodes.procs:  # our children: killed and reaped before the namespaces go
                    proc.kill()
                    proc.wait(timeout=30)
    finally:
        # the run's logs (serve's stderr, every Ray node's) stay in pytest's tmp_path
        with contextlib.suppress(shutil.Error, OSError):
            shutil.copytree(
                tmp, tmp_path / "run", ignore=shutil.ignore_patterns("sockets", "tiny", "ray_token")
            )
        shutil.rmtree(tmp, ignore_errors=True)
    leftovers = subprocess.run(
        ["pgrep", "-f", str(tmp)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert not leftovers, f"processes of the test survive it: {leftovers}"


def config(tmp: Path) -> Path:
    model = build_tiny_checkpoint(tmp / "tiny")
    values = {
        "model": {"source": str(model), "device": "cpu"},
        "engine": {"num_pages": 2048, "page_size": 4, "max_model_len": 1024},
        "workers": {"count": 2, "cpus_per_worker": 1, "host": "0.0.0.0"},
        "router": {
            "host": "127.0.0.1",
            "port": ROUTER_PORT,
            "http_port": 0,
            "policy": "round_robin",
            "resource": HEAD_RESOURCE,
        },
        "metrics": {"enabled": False},
        "drain_timeout_s": 10,
    }
    path = tmp / "radixmesh.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except AssertionError as err:  # a helper process that failed: try again
            last = err
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout} s (last: {last})")


WORKERS = """
out = {}
for name in ("worker-0", "worker-1"):
    info = ray.get(ray.get_actor(f"radixmesh-{name}").describe.remote(), timeout=60)
    out[name] = {"address": info["address"], "pid": info["pid"]}
router = ray.get_actor("radixmesh-router")
out["router"] = {"pid": ray.get(router.__ray_call__.remote(lambda self: os.getpid()), timeout=60)}
print(json.dumps(out))
"""


def root_listeners_of(pids: set[int]) -> list[str]:
    """The root namespace's listening sockets (TCP and UDP) that belong to one of `pids`."""
    out = subprocess.run(["ss", "-tulnpH"], capture_output=True, text=True, check=True).stdout
    return [
        line for line in out.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids
    ]


def wait_serving(out: Lines, stderr: Path, timeout: float = 180) -> None:
    """Until `radixmesh serve` prints its endpoint (Ray may print its own lines before)."""
    deadline, seen = time.monotonic() + timeout, []
    while True:
        try:
            line = out.next(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line == f"radixmesh serving on 127.0.0.1:{ROUTER_PORT}":
            return
        if line is None:  # ended, or the time is up
            raise AssertionError(f"not serving within {timeout} s: {seen}\n{stderr.read_text()}")
        seen.append(line)


def assert_contained(nodes: TwoNodes) -> None:
    """Each namespace holds lo and its end of the veth only, and nothing of the test listens in
    the root namespace (a socket a process of A or B holds there would show with its pid)."""
    for ns in (nodes.a, nodes.b):
        links = subprocess.run(
            ["ip", "-n", ns.name, "-o", "link", "show"], capture_output=True, text=True, check=True
        ).stdout
        assert sorted(re.findall(r"^\d+: ([^:@]+)", links, flags=re.MULTILINE)) == sorted(
            ["lo", ns.name]
        ), links
    ours = set(nodes.a.pids()) | set(nodes.b.pids()) | {os.getpid()}
    assert root_listeners_of(ours) == [], (nodes.a.listening(), nodes.b.listening())


def test_two_nodes_serve_and_survive_losing_one(two_nodes: TwoNodes) -> None:
    nodes, a, b = two_nodes, two_nodes.a, two_nodes.b
    began = time.monotonic()
    path = config(nodes.tmp)

    # -- two Ray nodes, radixmesh served on them --------------------------------------------------
    nodes.start_head()
    nodes.start_node_b(1)
    with (nodes.tmp / "serve.err").open("w") as serve_err:
        serve = subprocess.Popen(
            a.command([BIN / "radixmesh", "serve", "--config", path]),
            env=nodes.environment(RAY_ADDRESS=nodes.gcs), cwd=nodes.tmp,
            stdout=subprocess.PIPE, stderr=serve_err, text=True,
        )  # fmt: skip
    nodes.procs.append(serve)
    wait_serving(Lines(serve.stdout), nodes.tmp / "serve.err")
    print(f"serving after {time.monotonic() - began:.1f} s")

    placed = nodes.ray(WORKERS)
    hosts = {name: placed[name]["address"].rsplit(":", 1)[0] for name in ("worker-0", "worker-1")}
    assert sorted(hosts.values()) == sorted([a.address, b.address]), placed  # one per node
    on_a = next(name for name, host in hosts.items() if host == a.address)
    on_b = next(name for name, host in hosts.items() if host == b.address)
    assert placed[on_a]["pid"] in a.pids() and placed[on_b]["pid"] in b.pids(), placed
    assert placed["router"]["pid"] in a.pids(), placed  # pinned to the head
    routed = nodes.stats()
    assert {n: w["healthy"] for n, w in routed.items()} == {on_a: True, on_b: True}, routed
    assert routed[on_b]["address"] == placed[on_b]["address"], routed

    assert_contained(nodes)

    # -- load on both nodes; node B dies mid-stream ------------------------------------------------
    client, events = nodes.load(STREAMS, MAX_TOKENS, KILL_AFTER, "cut")
    running: dict[int, str] = {}
    done: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 120
    while len(running) < STREAMS and time.monotonic() < deadline:
        try:
            line = events.next(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            break
        assert line is not None, f"the client ended early: {client.stderr.read()[-3000:]}"  # type: ignore[union-attr]
        event = json.loads(line)
        if event["event"] == "running":
            running[event["i"]] = event["worker"]
        else:
            done[event["i"]] = event
    assert len(running) == STREAMS and not done, (running, done)
    assert set(running.values()) == {on_a, on_b}, running  # both nodes were serving
    killed_at = time.time()
    killed = b.kill_all()
    print(f"killed {len(killed)} processes of node B after {time.monotonic() - began:.1f} s")
    assert placed[on_b]["pid"] in killed

    while (line := events.next(timeout=180)) is not None:
        event = json.loads(line)
        if event["event"] == "done":
            done[event["i"]] = event
    assert client.wait(timeout=30) == 0, client.stderr.read()[-3000:]  # type: ignore[union-attr]
    assert set(done) == set(range(STREAMS)), done
    for i, event in sorted(done.items()):
        outcome = event["error"] or event["finish_reason"]
        print(
            f"stream {i}: {'>'.join(event['workers'])}, {event['tokens']} tokens, {outcome} "
            f"{event['t'] - killed_at:+.2f} s after the kill"
        )
    cut = {i: e for i, e in done.items() if running[i] == on_b and e["t"] > killed_at}
    assert cut, f"no stream on {on_b} was still running when node B died; raise MAX_TOKENS: {done}"
    for i, event in done.items():  # A's streams never noticed
        if running[i] == on_a:
            assert event["error"] is None and event["tokens"] == MAX_TOKENS, event
    # the target, asserted at the end so that the rest still runs: every client saw no error
    # and got its complete output; the cut streams finished on the node that survived
    incomplete = {
        i: e
        for i, e in done.items()
        if e["error"] is not None
        or e["tokens"] != MAX_TOKENS
        or e.get("finish_reason") != "length"
        or (i in cut and e["workers"][-1:] != [on_a])
    }

    wait_for(lambda: not nodes.stats().get(on_b, {}).get("healthy"), 30, f"{on_b} still routed")
    assert nodes.stats()[on_a]["healthy"]
    nodes.ray(
        f"""
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if not any(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == {b.address!r}):
        break
    time.sleep(0.5)
else:
    raise SystemExit("Ray still counts node B alive after 60 s")
print(json.dumps(True))
"""
    )
    print(f"Ray marked node B dead after {time.time() - killed_at:.1f} s")

    # -- node B comes back: its worker restarts there and rejoins routing --------------------------
    nodes.start_node_b(2)
    wait_for(
        lambda: nodes.stats().get(on_b, {}).get("healthy"),
        150,
        f"{on_b} did not rejoin the router after node B came back",
    )
    print(f"{on_b} rejoined {time.time() - killed_at:.1f} s after the kill")
    again = nodes.ray(WORKERS)
    assert again[on_b]["address"].startswith(f"{b.address}:"), again
    assert again[on_b]["pid"] != placed[on_b]["pid"] and again[on_b]["pid"] in b.pids(), again
    assert again[on_a] == placed[on_a] and again["router"] == placed["router"], again
    assert_contained(nodes)

    client, events = nodes.load(4, 16, 1, "after")
    ended = [json.loads(line) for line in iter(lambda: events.next(timeout=120), None)]
    assert client.wait(timeout=30) == 0
    finished = [e for e in ended if e["event"] == "done"]
    assert len(finished) == 4 and all(e["error"] is None and e["tokens"] == 16 for e in finished)
    assert {e["workers"][0] for e in finished} == {on_a, on_b}, finished

    # -- drain and stop --------------------------------------------------------------------------
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(timeout=90) == 0, (nodes.tmp / "serve.err").read_text()[-3000:]
    print(f"done after {time.monotonic() - began:.1f} s")

    assert not incomplete, (
        f"{len(incomplete)} of {STREAMS} streams did not complete for their client when node B "
        f"died ({len(cut)} were running on {on_b} then; streams cut mid-way must migrate to "
        f"{on_a}): {incomplete}"
    )
