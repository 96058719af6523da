"""`radixmesh loadtest`'s failures, without a model or Ray: flags refused before the server is
contacted, probe and Admin failures told apart, chaos that fails or comes too late, and the
bounds of a run. The servers are real gRPC servers on 127.0.0.1: the stub Serving, alone or
with the router's real Admin service and bearer-token interceptor (and no workers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cluster.auth import BearerTokenInterceptor
from cluster.config import ClusterConfig, SecuritySection
from cluster.loadtest import control
from cluster.loadtest.chaos import (
    KILL_FAILED,
    KILLED,
    RUN_ENDED_FIRST,
    ChaosEvent,
    ChaosPlan,
    account,
    failure,
)
from cluster.loadtest.checks import adapter_weights
from cluster.loadtest.cli import add_arguments, chaos_exit, main
from cluster.loadtest.grpc_api import Target
from cluster.loadtest.records import RequestRecord
from cluster.loadtest.report import chaos_markdown
from cluster.loadtest.runner import Arrivals, Bounds, Run
from cluster.loadtest.stub_server import StubServing
from cluster.loadtest.workloads import Session, WorkloadOptions, build
from cluster.policies import build_policy
from cluster.router_admin import AdminService
from cluster.worker_links import WorkerLinks
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc
from worker.event_loop import EventLoopThread
from worker.grpc_server import GrpcServer, start_server

TOKENS = {"token-admin": "*", "token-acme": "acme"}
SERVING = (serving_pb2_grpc.add_ServingServicer_to_server, "radixmesh.v1.Serving")
ADMIN = (serving_pb2_grpc.add_AdminServicer_to_server, "radixmesh.v1.Admin")


class BusyAdmin(serving_pb2_grpc.AdminServicer):
    """Refuses ClearCaches as the router does while a worker still runs requests."""

    def __init__(self) -> None:
        self.calls = 0

    async def ClearCaches(
        self, request: serving_pb2.ClearCachesRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ClearCachesResponse:
        self.calls += 1
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "worker-0 has requests running")
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def loop() -> Iterator[EventLoopThread]:
    thread = EventLoopThread("loadtest-errors")
    yield thread
    thread.stop()


def serve(loop: EventLoopThread, admin: object | None = None, tokens: bool = False) -> GrpcServer:
    register = [(SERVING[0], StubServing(), SERVING[1])]
    if admin is not None:
        register.append((ADMIN[0], admin, ADMIN[1]))
    security = SecuritySection(auth_tokens=TOKENS if tokens else {})
    interceptors = [BearerTokenInterceptor(security)]
    return loop.run(start_server(register, "127.0.0.1", 0, interceptors=interceptors))


@pytest.fixture(scope="module")
def stub(loop: EventLoopThread) -> Iterator[str]:
    """The stub alone: Serving without Admin."""
    server = serve(loop)
    yield f"127.0.0.1:{server.port}"
    loop.run(server.stop(0))


@pytest.fixture(scope="module")
def secured(loop: EventLoopThread) -> Iterator[str]:
    """The stub's Serving and the router's own Admin service, behind bearer tokens."""
    config = ClusterConfig(security=SecuritySection(auth_tokens=TOKENS))
    admin = AdminService(WorkerLinks(build_policy(config)), config)
    server = serve(loop, admin, tokens=True)
    yield f"127.0.0.1:{server.port}"
    loop.run(server.stop(0))


@pytest.fixture(autouse=True)
def no_ambient_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXMESH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def loadtest(target: str, out: Path, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--target", target, "--output-dir", str(out), "--warmup", "0", "--max-tokens", "4"]
    return main(parser.parse_args([*argv, "--num-requests", "6", *extra]))


def refused(
    capsys: pytest.CaptureFixture[str], code: int, out: Path, *expected: str, exit_code: int = 2
) -> str:
    err = capsys.readouterr().err
    assert code == exit_code, err
    for text in expected:
        assert text in err
    assert "Traceback" not in err
    assert not (out / "report.json").exists()
    return err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--sweep", "1,2", "--arrival", "trace"], "--sweep needs --arrival closed"),
        (["--sweep", "1,2", "--compare", "cache_aware", "round_robin"], "--sweep and --compare"),
        (["--chaos", "router@1", "--compare", "a", "b"], "--chaos works on a single run"),
        (["--chaos", "worker-1@1", "--sweep", "1,2"], "--chaos works on a single run"),
        (["--chaos", "worker0@10"], "TARGET being router or worker-<N>"),
        (["--chaos", "worker-0"], "--chaos wants TARGET@SECONDS"),
        (["--chaos", "worker-0@soon"], "the time 'soon' is not a number of seconds"),
        (["--chaos", "router@700"], "not before --max-seconds 600"),
        (["--sweep", "1,x"], "--sweep: 'x' is not a number"),
        (["--sweep", "1,2.5"], "a concurrency is a whole number of users, got 2.5"),
        (["--arrival", "poisson", "--sweep", "2,0"], "--sweep: '0' is not a number above 0"),
        (["--arrival", "poisson", "--rate", "0"], "--rate must be a finite number above 0"),
        (["--num-requests", "0"], "--num-requests must be at least 1"),
        (["--max-tokens", "-3"], "--max-tokens must be at least 1"),
        (["--trace-block-tokens", "100000000"], "--trace-block-tokens must be at most 512"),
        (["--tenants", "acme=lots"], "--tenants: the weight of 'acme' is 'lots'"),
        (["--adapters", "=0"], "--adapters: every weight is 0"),
        (["--adapters", "zipf:0"], "--adapters 'zipf:0': expected zipf:N or zipf:N:S"),
        (["--adapters", "zipf:8:-1"], "with N >= 1 adapters and an exponent S >= 0"),
        (["--workload", "trace", "--trace", "/no/such/trace.jsonl"], "is absent (--trace PATH)"),
        (["--tls-ca", "/no/such/ca.pem"], "--tls-ca /no/such/ca.pem: cannot be read"),
        (["--tls-cert", "/no/such/client.pem"], "need --tls-ca"),
        (["--text-match", "exact", "exact"], "--text-match names a mode twice"),
        (["--text-match", "exact", "off", "--sweep", "1,2"], "does not go with --compare, --sweep"),
        (["--workload", "trace", "--text-match", "exact"], "the trace workload sends token ids"),
    ],
)
def test_bad_flags_are_refused_before_the_server_is_contacted(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], expected: str
) -> None:
    # The target listens nowhere: a check made after the probe would say "cannot reach".
    ray = ["--ray-address", "127.0.0.1:1"] if "--chaos" in flags else []
    code = loadtest("127.0.0.1:1", tmp_path, *flags, *ray)
    err = refused(capsys, code, tmp_path, expected)
    assert "cannot reach" not in err


def test_chaos_without_a_ray_address_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    refused(
        capsys, loadtest("127.0.0.1:1", tmp_path, "--chaos", "router@5"), tmp_path, "RAY_ADDRESS"
    )


def test_an_output_dir_that_is_a_file_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "taken"
    out.write_text("")
    code = loadtest("127.0.0.1:1", out)
    assert code == 2 and "--output-dir" in capsys.readouterr().err


def test_missing_credentials_are_told_apart_from_an_unreachable_target(
    secured: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = refused(capsys, loadtest(secured, tmp_path), tmp_path, "refused the credentials")
    assert "UNAUTHENTICATED" in err and "cannot reach" not in err and "--token" in err
    code = loadtest(secured, tmp_path, "--token", "token-wrong")
    refused(capsys, code, tmp_path, "refused the credentials: UNAUTHENTICATED")


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, "cannot reach h:1: UNAVAILABLE: why"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "cannot reach h:1: DEADLINE_EXCEEDED"),
        (grpc.StatusCode.UNAUTHENTICATED, "h:1 refused the credentials: UNAUTHENTICATED: why"),
        (grpc.StatusCode.PERMISSION_DENIED, "h:1 refused the credentials: PERMISSION_DENIED"),
        (grpc.StatusCode.INTERNAL, "h:1 failed the probe (GetStats): INTERNAL: why"),
    ],
)
def test_each_probe_failure_reads_as_what_it_is(code: grpc.StatusCode, expected: str) -> None:
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "why")
    assert expected in str(control.probe_error("h:1", error))


def test_the_token_defaults_to_radixmesh_token(
    secured: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RADIXMESH_TOKEN", "token-acme")
    assert loadtest(secured, tmp_path / "env") == 0
    report = json.loads((tmp_path / "env" / "report.json").read_text())
    assert report["runs"][0]["summary"]["requests"]["completed"] == 6
    monkeypatch.setenv("RADIXMESH_TOKEN", "token-wrong")  # --token wins over the environment
    assert loadtest(secured, tmp_path / "flag", "--token", "token-acme") == 0


def test_compare_and_sweep_against_a_server_without_admin_say_so(
    stub: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = loadtest(stub, tmp_path, "--compare", "cache_aware", "round_robin")
    refused(capsys, code, tmp_path, "has no Admin service", "Admin.SetPolicy: UNIMPLEMENTED")
    code = loadtest(stub, tmp_path, "--sweep", "1,2", "--warmup", "2")  # after the warmup
    refused(capsys, code, tmp_path, "has no Admin service", "Admin.ClearCaches")


def test_admin_refusals_name_the_call_and_the_reason(
    secured: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = loadtest(
        secured, tmp_path, "--token", "token-acme", "--compare", "sglang", "cache_aware"
    )
    refused(capsys, code, tmp_path, "refused Admin.SetPolicy: PERMISSION_DENIED", "'*'")
    code = loadtest(secured, tmp_path, "--token", "token-admin", "--sweep", "1,2")
    assert code == 0, capsys.readouterr().err  # the admin token may
    assert (tmp_path / "sweep.png").exists()
    (tmp_path / "report.json").unlink()
    code = loadtest(secured, tmp_path, "--token", "token-admin", "--compare", "best", "sglang")
    refused(capsys, code, tmp_path, "refused the policy 'best': INVALID_ARGUMENT", "cache_aware")


def test_clear_caches_refused_after_every_retry_says_so(loop: EventLoopThread) -> None:
    busy = BusyAdmin()
    server = serve(loop, busy)
    try:
        target = Target(f"127.0.0.1:{server.port}")
        with pytest.raises(control.ServerError, match=r"still refused Admin\.ClearCaches after 3"):
            asyncio.run(control.admin(target, attempts=3, interval_s=0.01))
        assert busy.calls == 3
    finally:
        loop.run(server.stop(0))


def test_a_malformed_trace_is_named_with_its_line(
    stub: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 40, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(good) + "\n" + json.dumps({"timestamp": 5}) + "\n")
    code = loadtest(stub, tmp_path, "--workload", "trace", "--trace", str(trace), "--warmup", "2")
    refused(capsys, code, tmp_path, f"the trace {trace}, line 2: no 'hash_ids' field")


class FailingKill(ChaosPlan):
    """A kill whose subprocess fails as Ray's does for an actor that does not exist."""

    def kill(self) -> None:
        message = "ValueError: Failed to look up actor with name 'radixmesh-worker-7'"
        code = f"import sys; print({message!r}, file=sys.stderr); sys.exit(1)"
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=30)


class QuietKill(ChaosPlan):
    """A kill that succeeds and changes nothing (the stub has no workers to count)."""

    def kill(self) -> None:
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=30)


def timed_sessions(count: int, gap_s: float) -> list[Session]:
    sessions = build("random", WorkloadOptions(requests=count, max_tokens=4, max_model_len=256))
    for i, session in enumerate(sessions):
        session.arrival_s = i * gap_s
    return sessions


def run(
    target: str,
    sessions: list[Session],
    arrivals: Arrivals,
    bounds: Bounds,
    plan: ChaosPlan | None = None,
) -> tuple[Run, float]:
    began = time.monotonic()
    runner = Run(Target(target), sessions, arrivals, bounds, chaos=plan)
    asyncio.run(runner.run())
    return runner, time.monotonic() - began


def test_a_failed_kill_is_reported_and_the_run_goes_on(stub: str) -> None:
    plan = FailingKill("worker-7", 0.1, "127.0.0.1:1")
    runner, _ = run(stub, timed_sessions(6, 0.1), Arrivals("trace"), Bounds(6, 30), plan)
    report = runner.chaos_report
    assert report is not None and report["outcome"] == KILL_FAILED
    assert "Failed to look up actor" in str(report["error"])
    assert report["in_flight"] is None
    assert len(runner.records) == 6 and all(r.ok for r in runner.records)
    assert "the kill of the worker-7 at 0.1 s failed: ValueError" in chaos_markdown(report)


def test_no_kill_once_the_requests_are_done(stub: str) -> None:
    plan = ChaosPlan("worker-0", 20.0, "127.0.0.1:1")  # a real kill would fail: no Ray there
    runner, took = run(stub, timed_sessions(3, 0.0), Arrivals("closed", 2), Bounds(3, 60), plan)
    report = runner.chaos_report
    assert report is not None and report["outcome"] == RUN_ENDED_FIRST
    assert report["at_s"] is None and report["error"] is None
    assert took < 10  # not waiting for the planned 20 s
    assert "no kill" in chaos_markdown(report) and "planned at 20.0 s" in chaos_markdown(report)


def test_the_recovery_watch_ends_at_max_seconds(stub: str) -> None:
    plan = QuietKill("worker-0", 0.1, "127.0.0.1:1")
    bounds = Bounds(6, 2.0)
    runner, took = run(stub, timed_sessions(6, 0.1), Arrivals("trace"), bounds, plan)
    report = runner.chaos_report
    assert report is not None and report["outcome"] == KILLED
    assert report["all_workers_healthy_after_s"] is None  # the stub never reports a worker
    assert 1.5 < took < 8  # the watch stopped at --max-seconds, not 300 s after the kill
    assert "healthy again: not before the watch ended" in chaos_markdown(report)
    assert report["recovered"] is False and "did NOT recover" in chaos_markdown(report)
    assert chaos_exit(report) == 1  # `loadtest --chaos` fails when the cluster did not recover
    assert chaos_exit({**report, "all_workers_healthy_after_s": 1.0, "recovered": True}) == 0


def test_waits_for_the_next_arrival_stop_at_the_bounds(stub: str) -> None:
    # Poisson gaps of 100 s on average: the run still ends at its 0.5 s deadline.
    runner, took = run(stub, timed_sessions(4, 0), Arrivals("poisson", rate=0.01), Bounds(9, 0.5))
    assert len(runner.records) == 1 and took < 3
    # Trace arrivals 100 s apart, the same.
    runner, took = run(stub, timed_sessions(4, 100), Arrivals("trace"), Bounds(9, 0.5))
    assert len(runner.records) == 1 and took < 3
    # One request allowed: the run ends when it does, not at the next arrival or deadline.
    runner, took = run(stub, timed_sessions(4, 0), Arrivals("poisson", rate=0.01), Bounds(1, 60))
    assert len(runner.records) == 1 and took < 3 and runner.duration < 1


def test_a_timed_out_kill_reads_as_one() -> None:
    assert failure(subprocess.TimeoutExpired("python", 120)) == (
        "the kill did not finish within 120 s"
    )


def test_requests_sent_while_the_server_is_down_wait_for_it(loop: EventLoopThread) -> None:
    """What a router restart looks like to the harness: the port refuses connections for a few
    seconds. Requests wait for the channel (wait_for_ready) and are served once it is back,
    as a production client's would be, instead of failing in a burst against a closed port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    timer = threading.Timer(1.5, lambda: servers.append(serve_on(loop, port)))
    servers: list[GrpcServer] = []
    timer.start()
    try:
        runner, took = run(
            f"127.0.0.1:{port}", timed_sessions(4, 0.0), Arrivals("closed", 4), Bounds(4, 30)
        )
    finally:
        timer.join()
        for server in servers:
            loop.run(server.stop(0))
    assert len(runner.records) == 4 and all(r.ok for r in runner.records), runner.records
    assert all(r.start < 1.0 for r in runner.records)  # sent while nothing listened
    assert took >= 1.5


def serve_on(loop: EventLoopThread, port: int) -> GrpcServer:
    return loop.run(start_server([(SERVING[0], StubServing(), SERVING[1])], "127.0.0.1", port))


def test_a_request_sent_while_the_kill_ran_counts_as_in_flight() -> None:
    """The actor dies somewhere between the kill call (at_s) and its return: a request sent in
    between went through the dying actor, and is not one 'sent after the kill'."""
    records = [
        RequestRecord(0, 0, "before", "", "", start=9.0, end=12.0, status="UNAVAILABLE"),
        RequestRecord(1, 0, "during", "", "", start=10.5, end=10.6, status="UNAVAILABLE"),
        RequestRecord(2, 0, "after", "", "", start=11.5, end=13.0),
    ]
    event = ChaosEvent(attempted_at=10.0, done_at=11.0, whole_again_s=2.0)
    report = account(records, event, ChaosPlan("router", 10.0, "127.0.0.1:1"), 13.0)
    assert report["in_flight"] == 2 and report["in_flight_outcomes"] == {"UNAVAILABLE": 2}
    assert report["kill_returned_at_s"] == 11.0
    assert report["recovery_s"] == 3.0 and report["recovered"] is True
    assert report["errors"] == 2 and report["truncated"] == 0


def test_zipf_adapters_name_lora_k_by_falling_weight() -> None:
    drawn = adapter_weights("zipf:4:1")
    assert [name for name, _ in drawn] == ["lora-0", "lora-1", "lora-2", "lora-3"]
    assert [round(w, 4) for _, w in drawn] == [1.0, 0.5, 0.3333, 0.25]
    assert adapter_weights("=3,sql=1") == [("", 3.0), ("sql", 1.0)]
