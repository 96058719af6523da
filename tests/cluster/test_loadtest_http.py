"""`radixmesh loadtest --api openai`: the same workloads through the router's OpenAI API, against
real local clusters (tiny model, two workers, the HTTP API on loopback; one plain, one with TLS
and bearer tokens), and the client's reading of streams that fail, from a real HTTP server on
loopback answering with canned bytes (tests/cluster/http_stub.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx2
import pytest

from cluster.config import SecuritySection
from cluster.loadtest.cli import add_arguments, main
from cluster.loadtest.openai_api import HttpConnection, HttpTarget, base_url, request_body
from cluster.loadtest.records import RequestRecord
from cluster.loadtest.workloads import RequestSpec, Session
from cluster.policies import build_policy
from tests.cluster.certs import make_certificates
from tests.cluster.http_stub import HttpStub, Reply
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MAX_TOKENS = 6
TOKENS = {"token-admin": "*", "token-acme": "acme"}


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny, http=True)
    yield running
    running.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secured(tiny: LoadedModel, certs: dict[str, Path]) -> Iterator[LocalCluster]:
    """HTTPS (the gRPC port's certificate) and bearer tokens."""
    security = SecuritySection(
        tls_cert=str(certs["cert"]), tls_key=str(certs["key"]), auth_tokens=TOKENS
    )
    running = start_cluster(tiny, security=security, http=True)
    yield running
    running.close()


@pytest.fixture(autouse=True)
def no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXMESH_TOKEN", raising=False)


def loadtest(out: Path, *flags: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--output-dir", str(out), "--max-tokens", str(MAX_TOKENS), "--warmup", "4", *flags]
    code = main(parser.parse_args(argv))
    report = json.loads((out / "report.json").read_text()) if code == 0 else {}
    return code, report


def over_http(cluster: LocalCluster, out: Path, *flags: str) -> tuple[int, dict]:
    return loadtest(out, "--api", "openai", "--target", cluster.http_url, *flags)


def trace_file(path: Path) -> Path:
    records = [
        {"timestamp": 10 * i, "input_length": 600, "output_length": 40, "hash_ids": [0, 1, i % 2]}
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("workload", "path"),
    [
        ("shared-prefix", "completions (text)"),
        ("multi-turn", "chat"),
        ("plain-multi-turn", "completions (text), text_match anchored"),
        ("trace", "token ids"),
    ],
)
def test_a_run_over_the_openai_api_completes_with_cache_hits(
    cluster: LocalCluster, tmp_path: Path, workload: str, path: str
) -> None:
    flags = ["--workload", workload, "--num-requests", "8", "--concurrency", "3"]
    if workload == "trace":  # token ids must lie in the vocabulary, which GetStats reports
        flags += ["--trace", str(trace_file(tmp_path / "t.jsonl")), "--grpc-target", cluster.target]
    if workload == "plain-multi-turn":
        flags += ["--text-match", "anchored"]
    code, report = over_http(cluster, tmp_path, *flags)
    assert code == 0
    (run,) = report["runs"]
    summary = run["summary"]
    assert summary["requests"] == {"sent": 8, "completed": 8, "errored": 0}, summary["errors"]
    assert summary["hit_rate"] > 0
    assert run["settings"]["api"] == "openai" and run["settings"]["model"] == SERVED_NAME
    assert run["settings"]["target"] == cluster.http_url
    for record in run["requests"]:
        assert record["status"] == "OK" and record["finish_reason"] == "length"
        assert record["ttft"] > 0 and record["prompt_tokens"] > 0
        expected = 2 if workload == "trace" else MAX_TOKENS  # the trace's 40 tokens scaled: 2.5
        assert record["output_tokens"] == expected  # the usage chunk's count
        assert record["worker"] in cluster.engines  # from the router's response headers
        assert isinstance(record["predicted_cached_tokens"], int)
    assert set(summary["workers"]) <= set(cluster.engines) and summary["workers"]
    assert summary["prediction"]["mean_abs_error_tokens"] is not None
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith(f"API: openai, {cluster.http_url}, model {SERVED_NAME}\n")
    assert "| prediction error (tokens) | - |" not in text
    if workload == "plain-multi-turn":  # the body's text_match reached the router's index
        assert run["settings"]["text_match"] == "anchored"
        texts = cluster.service.text_prompts
        assert texts is not None and texts.counters.outcomes.get("extend", 0) > 0
    cluster.wait_idle()


def test_grpc_and_openai_runs_of_one_workload_report_the_same_requests(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    flags = ["--workload", "shared-prefix", "--num-requests", "10", "--concurrency", "2"]
    code, grpc_report = loadtest(tmp_path / "grpc", "--target", cluster.target, *flags)
    assert code == 0
    code, http_report = over_http(cluster, tmp_path / "http", *flags)
    assert code == 0
    (by_grpc,), (by_http,) = grpc_report["runs"], http_report["runs"]
    assert by_grpc["settings"]["api"] == "grpc" and by_http["settings"]["api"] == "openai"
    for run in (by_grpc, by_http):
        assert run["summary"]["requests"] == {"sent": 10, "completed": 10, "errored": 0}

    def requests(run: dict) -> list[tuple[int, int, int]]:
        return sorted(
            (r["session"], r["prompt_tokens"], r["output_tokens"]) for r in run["requests"]
        )

    assert requests(by_grpc) == requests(by_http)  # the same prompts, tokenised alike
    assert (tmp_path / "grpc" / "summary.md").read_text().startswith("API: grpc, 127.0.0.1:")
    cluster.wait_idle()


def test_compare_over_the_openai_api_switches_policies_through_grpc(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    code, report = over_http(
        cluster, tmp_path, "--workload", "multi-turn", "--num-requests", "8", "--turns", "4",
        "--concurrency", "2", "--compare", "round_robin", "cache_aware",
        "--grpc-target", cluster.target,
    )  # fmt: skip
    assert code == 0
    assert [run["label"] for run in report["runs"]] == ["round_robin", "cache_aware"]
    assert all(run["summary"]["requests"]["completed"] == 8 for run in report["runs"])
    assert all(run["settings"]["api"] == "openai" for run in report["runs"])
    cluster.loop.run(cluster.links.replace_policy(build_policy(cluster.config)))  # as before


def refused(capsys: pytest.CaptureFixture[str], code: int, out: Path, *expected: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err
    assert not (out / "report.json").exists()
    return err


def test_an_unreachable_url_ends_within_seconds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    began = time.monotonic()
    code, _ = loadtest(tmp_path, "--api", "openai", "--target", "http://127.0.0.1:1")
    assert time.monotonic() - began < 5
    refused(capsys, code, tmp_path, "cannot reach http://127.0.0.1:1: ConnectError")


def test_a_refused_token_ends_within_seconds_naming_it(
    secured: LocalCluster,
    certs: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    url, ca = secured.http_url, str(certs["ca"])
    assert url.startswith("https://")
    for token in ([], ["--token", "token-wrong"]):
        began = time.monotonic()
        code, _ = loadtest(tmp_path, "--api", "openai", "--target", url, "--tls-ca", ca, *token)
        assert time.monotonic() - began < 5
        err = refused(capsys, code, tmp_path, f"{url} refused the credentials: HTTP 401", "--token")
        assert "cannot reach" not in err


def test_https_with_a_token_serves_and_a_forbidden_tenant_is_counted_by_status(
    secured: LocalCluster, certs: dict[str, Path], tmp_path: Path
) -> None:
    base = ["--api", "openai", "--target", secured.http_url, "--tls-ca", str(certs["ca"])]
    base += ["--token", "token-acme", "--num-requests", "6", "--warmup", "0"]
    code, report = loadtest(tmp_path / "acme", *base, "--tenants", "acme")
    assert code == 0
    assert report["runs"][0]["summary"]["requests"]["completed"] == 6
    code, report = loadtest(tmp_path / "globex", *base, "--tenants", "globex")
    assert code == 0  # failed requests are the run's to count, not the command's to stop on
    assert report["runs"][0]["summary"]["errors"] == {"HTTP_403": 6}


def test_plain_http_to_a_tls_port_cannot_reach_it(
    secured: LocalCluster, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plain = secured.http_url.replace("https://", "http://")
    code, _ = loadtest(tmp_path, "--api", "openai", "--target", plain)
    refused(capsys, code, tmp_path, f"cannot reach {plain}")


def test_an_unknown_model_is_named(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _ = over_http(cluster, tmp_path, "--model", "gpt-9")
    refused(
        capsys, code, tmp_path, "does not serve the model 'gpt-9' (--model); it serves ['tiny']"
    )


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--target", "http://127.0.0.1:1"], "is a URL: gRPC takes HOST:PORT (for the HTTP API"),
        (["--model", "tiny"], "--model is for --api openai"),
        (["--grpc-target", "127.0.0.1:1"], "--grpc-target is for --api openai"),
        (["--api", "openai", "--target", "127.0.0.1:8000"], "is not the HTTP API's base URL"),
        (["--api", "openai", "--target", "ftp://h:1"], "is not the HTTP API's base URL"),
        (["--api", "openai", "--compare", "a", "b"], "also give the router's gRPC address"),
        (["--api", "openai", "--sweep", "1,2"], "(--grpc-target HOST:PORT)"),
        (["--api", "openai", "--text-match", "off", "exact"], "(--grpc-target HOST:PORT)"),
        (["--api", "openai", "--grpc-target", "http://h:1"], "--grpc-target http://h:1 is a URL"),
        (["--api", "openai", "--tls-ca", "/no/ca.pem"], "--tls-ca is for an https:// target"),
        (
            ["--api", "openai", "--target", "https://127.0.0.1:1", "--tls-ca", "/no/ca.pem"],
            "--tls-ca /no/ca.pem: cannot be read",
        ),
    ],
)
def test_flags_that_do_not_fit_the_api_are_refused_before_any_call(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], expected: str
) -> None:
    code, _ = loadtest(tmp_path, *flags)
    err = refused(capsys, code, tmp_path, expected)
    assert "cannot reach" not in err


def test_base_urls_drop_the_v1_that_serve_prints() -> None:
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert base_url("https://router.example:443") == "https://router.example:443"
    path, body = request_body(RequestSpec(4, token_ids=(1, 2)), "m")
    assert path == "/v1/completions" and body["prompt"] == [1, 2]
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    path, body = request_body(RequestSpec(4, chat=(("user", "hi"),)), "m")
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hi"}] and "text_match" not in body
    assert request_body(RequestSpec(4, text="hi"), "m", "anchored")[1]["text_match"] == "anchored"


# -- streams that go wrong, from a real server's canned bytes --------------------------------------
def event(data: object) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


def chunk(text: str, finish: str | None = None) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


USAGE = event(
    {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                              "prompt_tokens_details": {"cached_tokens": 4}}}
)  # fmt: skip
DONE = b"data: [DONE]\n\n"


def send(
    stub: HttpStub, on_attempt: Callable[[httpx2.Request], Awaitable[None]] | None = None
) -> RequestRecord:
    """One text request to `stub` over loopback, through the client the load test builds;
    `on_attempt` runs before each try to connect (httpx2's request hook)."""
    record = RequestRecord(0, 0, "lt-0-0-1", "", "", 0.0)
    clock = iter(range(100))

    async def go() -> None:
        target = HttpTarget(stub.url, model="m")
        async with stub, target.client(timeout=None) as client:
            if on_attempt is not None:
                client.event_hooks = {"request": [on_attempt]}
            await HttpConnection(client, target).generate(
                RequestSpec(3, text="hi"), Session(0), record, lambda: float(next(clock)), 5.0
            )

    asyncio.run(go())
    return record


def test_a_whole_stream_fills_the_record() -> None:
    stub = HttpStub(Reply(chunks=(chunk("a"), chunk(""), chunk("bc", "length"), USAGE, DONE)))
    record = send(stub)
    assert record.ok and record.answer == "abc" and record.finish_reason == "length"
    assert record.first_token == 0.0 and record.token_times == [0.0, 2.0]  # "" is no token time
    assert (record.output_tokens, record.prompt_tokens, record.cached_prompt_tokens) == (3, 9, 4)
    (seen,) = stub.seen
    assert (seen.method, seen.target) == ("POST", "/v1/completions")
    assert json.loads(seen.body)["prompt"] == "hi"


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        pytest.param(
            Reply(chunks=(event({"error": {"message": "failed", "type": "server_error"}}), DONE)),
            "STREAM_ERROR",
            id="error-event",
        ),
        pytest.param(Reply(chunks=(chunk("a"),)), "DISCONNECTED", id="body-ends-without-done"),
        pytest.param(
            Reply(chunks=(chunk("a"), chunk("b")[:20]), cut=True),
            "DISCONNECTED",
            id="connection-closed-mid-body",
        ),
        pytest.param(Reply(chunks=(event(b"{not json"), DONE)), "PROTOCOL_ERROR", id="not-json"),
        pytest.param(
            Reply(429, (b'{"error": {"message": "busy"}}',), "application/json"),
            "HTTP_429",
            id="429",
        ),
    ],
)
def test_a_failed_stream_is_recorded_by_what_failed(reply: Reply, expected: str) -> None:
    record = send(HttpStub(reply))
    assert record.status == expected


def test_a_refused_connection_is_tried_again_until_it_is_served() -> None:
    """As gRPC's wait_for_ready: a router restarting refuses connections for a while. The stub's
    port is bound but not listening, so the kernel refuses the first two tries; it listens from
    the third on."""
    stub = HttpStub(Reply(chunks=(chunk("a", "length"), USAGE, DONE)), listening=False)
    attempts = []

    async def attempt(request: httpx2.Request) -> None:
        attempts.append(request)
        if len(attempts) == 3:
            await stub.listen()

    assert send(stub, attempt).ok and len(attempts) == 3
    (seen,) = stub.seen  # the two refused tries never reached it
    assert seen.headers["x-request-id"] == "lt-0-0-1"
