"""radixmesh on a real Ray cluster (`ray start --head` on 127.0.0.1): serve, fail, recover.

`radixmesh serve` runs as its own process against the cluster (RAY_ADDRESS), and again through
`ray job submit`. The test process joins the same cluster to find the named actors and kill
them: a killed worker restarts and rejoins the router; a killed router restarts on its port.

The cluster's Ray token is a file made here, handed to every process through RAY_AUTH_TOKEN_PATH
(nothing is read from, or written to, ~/.ray); a process with another token is refused.
"""

from __future__ import annotations

import contextlib
import json
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
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cluster.client import Client, text_request
from cluster.ray_runtime import NAMESPACE
from cluster.ray_token import MODE_ENV, PATH_ENV, TOKEN_ENV, create_token_file, token_environment
from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster.listening import LOOPBACK, listening_addresses
from worker.tiny_model import build_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The router knows which worker holds which prefix, and sends the request there. "
STOP_WAIT = '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}'
"""How long `ray job stop` lets the job drain before SIGKILL, as the README submits it (Ray's
default, 3 s, cuts the streams a drain would finish: docs/serving.md). This test's tiny model
drains within 3 s too; the time matters for real streams."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(token: str | Path, **extra: str) -> dict[str, str]:
    """Loopback only, token authentication on with the cluster's token file, our venv first."""
    env = {k: v for k, v in os.environ.items() if k not in (MODE_ENV, PATH_ENV, TOKEN_ENV)}
    env.update(token_environment(Path(token)), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


def ray_process(
    head: dict[str, str], code: str, token: str | Path
) -> subprocess.CompletedProcess[str]:
    """`code` run in a fresh process that joins the cluster with `token` (ray reads its auth mode
    at import); `actor(name)` is the named actor."""
    prelude = (
        "import ray\n"
        f"ray.init(address={head['address']!r}, namespace={NAMESPACE!r}, logging_level='ERROR')\n"
        "actor = lambda name: ray.get_actor(name)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        env=environment(token), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def ray_call(head: dict[str, str], code: str) -> str:
    """Run `code` joined to the cluster with its token; whatever the code prints comes back."""
    out = ray_process(head, code, head["token"])
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def session_processes(session: int) -> list[int]:
    """The processes of the session `session` leads: a `ray start --block` and all it started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == session:
                    pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A `ray start --head` cluster on 127.0.0.1 with a token file made here. `--block`, in a
    session of its own, so that the teardown stops this cluster only: `ray stop` would stop every
    Ray cluster of this user on the machine."""
    base = tmp_path_factory.mktemp("ray-head")
    gcs, dashboard = free_port(), free_port()
    token = create_token_file(base / "token")
    log = base / "ray-start.log"
    with log.open("w") as out:
        start = subprocess.Popen(
            [
                BIN / "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                "--num-cpus=6", "--disable-usage-stats",
            ],
            env=environment(token), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "block forever" not in log.read_text():  # printed once the cluster is up
            assert start.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield {
            "address": f"127.0.0.1:{gcs}",
            "dashboard": f"http://127.0.0.1:{dashboard}",
            "token": str(token),
            "pid": str(start.pid),
        }
    finally:
        start.terminate()  # `ray start --block` stops its processes on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            start.wait(timeout=60)
        for pid in session_processes(start.pid):  # whatever outlived it, by id
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        start.wait(timeout=60)


def write_config(base: Path, source: str, **router: object) -> Path:
    """A two-worker CPU cluster serving `source`, on free ports; `router` keys override."""
    config = {
        "model": {"source": source, "device": "cpu"},
        "engine": {"num_pages": 256, "page_size": 4, "max_model_len": 512},
        "workers": {"count": 2},
        "router": {
            "port": free_port(),
            "http_port": free_port(),
            "policy": "cache_aware",
            **router,
        },
        "metrics": {"router_port": free_port(), "worker_port": free_port()},
        "drain_timeout_s": 10,
    }
    path = base / "radixmesh.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    base = tmp_path_factory.mktemp("ray")
    state = str(base / "state")  # batches one at a time: a router killed under one cuts it
    return write_config(base, str(tiny_model), state_dir=state, batch_max_in_flight=1)


def ended_with(serve: subprocess.Popen[str]) -> str:
    """Why `radixmesh serve` printed nothing: its exit status and the end of its stderr."""
    try:
        code = serve.wait(timeout=60)
    except subprocess.TimeoutExpired:
        return "serve closed its stdout and still runs"
    return f"serve exited {code}: {serve.stderr.read()[-3000:]}"  # type: ignore[union-attr]


@contextlib.contextmanager
def serving(head: dict[str, str], config: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`radixmesh serve --config config` joined to the cluster, once it prints its endpoint; a
    process still running at the end is stopped (SIGTERM, then SIGKILL)."""
    env = environment(head["token"], RAY_ADDRESS=head["address"])
    serve = subprocess.Popen(
        [BIN / "radixmesh", "serve", "--config", str(config)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    target = endpoint(config)
    try:
        line = serve.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == f"radixmesh serving on {target}", line or ended_with(serve)
        line = serve.stdout.readline()  # type: ignore[union-attr]
        expected = f"OpenAI and Anthropic APIs on {http_url(config)}/v1"
        assert line.strip() == expected, line or ended_with(serve)
        yield serve, target
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=120)
            except subprocess.TimeoutExpired:
                serve.kill()


def router_pid(head: dict[str, str]) -> int:
    return int(ray_call(head, "print(ray.get(actor('radixmesh-router').describe.remote())['pid'])"))


def http_url(config_file: Path) -> str:
    return f"http://127.0.0.1:{yaml.safe_load(config_file.read_text())['router']['http_port']}"


def http_answer(config_file: Path) -> openai.types.Completion:
    """A completion through the router actor's HTTP API, with the official SDK: three tokens,
    never fewer (sampled at OpenAI's default temperature, the random tiny model once drew its
    end-of-sequence token among them: `stop`, not `length`)."""
    url = http_url(config_file)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        model = client.models.list().data[0].id
        return client.completions.create(
            model=model, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
        )


def stored_response(config_file: Path) -> str:
    """The id of a response the router actor's HTTP API stored."""
    url = http_url(config_file)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        model = client.models.list().data[0].id
        made = client.responses.create(model=model, input=PROMPT, max_output_tokens=3)
        assert client.responses.retrieve(made.id).store
        return made.id


BATCH_LINES = 6


def running_batch(config_file: Path) -> str:
    """A batch of the router actor's Batch API, once its first line is answered (its lines
    run one at a time, each long enough that the batch still runs when the router is killed
    right after)."""
    with openai.OpenAI(base_url=f"{http_url(config_file)}/v1", api_key="none") as client:
        model = client.models.list().data[0].id
        lines = [
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": model, "prompt": f"{i} {PROMPT}", "max_tokens": 400,
                         "ignore_eos": True},
            }
            for i in range(BATCH_LINES)
        ]  # fmt: skip
        text = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = client.files.create(file=("b.jsonl", text), purpose="batch").id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )

        def answered() -> bool:
            counts = client.batches.retrieve(batch.id).request_counts
            return counts is not None and counts.completed >= 1

        wait_for(answered, 120, "the batch's first line was not answered")
        return batch.id


def journalled(config_file: Path, batch_id: str) -> dict[str, str]:
    """custom id -> request id of the lines the batch's journal holds (router.state_dir)."""
    state = Path(yaml.safe_load(config_file.read_text())["router"]["state_dir"])
    rows = (state / "batches" / f"{batch_id}.answers.jsonl").read_bytes().splitlines()
    return {e["answer"]["custom_id"]: e["answer"]["id"] for e in map(json.loads, rows)}


def batch_after_restart(config_file: Path, batch_id: str) -> dict[str, str]:
    """custom id -> request id of the output of a batch created before the router restarted,
    once the restarted router ended it (router.state_dir: it goes on)."""
    with openai.OpenAI(base_url=f"{http_url(config_file)}/v1", api_key="none") as client:
        deadline = time.monotonic() + 180
        batch = client.batches.retrieve(batch_id)
        while batch.status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {batch.status}"
            time.sleep(0.2)
            batch = client.batches.retrieve(batch_id)
        assert batch.status == "completed", batch
        assert batch.output_file_id is not None and batch.error_file_id is None
        output = client.files.content(batch.output_file_id).content.decode()
        answered = [json.loads(row) for row in output.splitlines()]
        assert all(a["response"]["status_code"] == 200 for a in answered)
        return {a["custom_id"]: a["id"] for a in answered}


def continued_response(config_file: Path, response_id: str) -> str:
    """A response stored before the router was killed, continued after it restarted (its
    file in router.state_dir read back); the follow-up's status."""
    url = http_url(config_file)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
        model = client.models.list().data[0].id
        assert client.responses.retrieve(response_id).id == response_id
        return client.responses.create(
            model=model, input="Go on.", previous_response_id=response_id, max_output_tokens=3
        ).status


def structured_answer(config_file: Path) -> str:
    """A chat answered in a JSON schema through the router actor's HTTP API (the random tiny
    model writes JSON only under the constraint)."""
    schema = {
        "type": "object",
        "properties": {"tier": {"enum": ["device", "host", "disk"]}},
        "required": ["tier"],
        "additionalProperties": False,
    }
    with openai.OpenAI(
        base_url=f"{http_url(config_file)}/v1", api_key="none", max_retries=0
    ) as client:
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Which tier?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
            max_tokens=60,
            temperature=1.0,
            seed=1,
        )
    assert reply.choices[0].finish_reason == "stop", reply
    return reply.choices[0].message.content or ""


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


def read_across_workers(client: Client, holder: str) -> None:
    """Two worker actors, each its own process: `holder` caches a prompt, the other reads its KV
    from it (`kv_peer`, at the address the router reaches `holder` at) instead of recomputing."""
    workers = {w.worker: w for w in client.stats().workers if w.healthy}
    reader = next(name for name in workers if name != holder)
    sampling = serving_pb2.SamplingParams(max_tokens=2, temperature=0.0)

    def generate(
        worker: str, tokens: list[int], peer: worker_pb2.KvPeer | None = None
    ) -> list[serving_pb2.GenerateResponse]:
        with grpc.insecure_channel(workers[worker].address) as channel:
            ask = worker_pb2.WorkerGenerateRequest(
                request_id=f"peer-{worker}", token_ids=tokens, sampling=sampling, kv_peer=peer
            )
            return list(worker_pb2_grpc.WorkerStub(channel).Generate(ask, timeout=60))

    prompt = list(range(1, 42))  # 10 whole pages of 4
    generate(holder, prompt)
    longer = [*prompt, 7, 8, 9]
    peer = worker_pb2.KvPeer(worker=holder, address=workers[holder].address, positions=43)
    read = generate(reader, longer, peer)
    assert (read[-1].cached_prompt_tokens, read[-1].peer_cached_tokens) == (40, 40)
    answer = [t for r in generate(holder, longer) for t in r.token_ids]
    assert [t for r in read for t in r.token_ids] == answer, "the answer the holder gives"


def test_serve_survives_worker_and_router_deaths(head: dict[str, str], config_file: Path) -> None:
    with serving(head, config_file) as (serve, target):
        client = Client(target)
        first = list(client.generate(text_request(PROMPT + "one", max_tokens=4)))[-1]
        second = list(client.generate(text_request(PROMPT + "two", max_tokens=4)))[-1]
        assert second.worker == first.worker and second.cached_prompt_tokens > 0
        read_across_workers(client, first.worker)
        over_http = http_answer(config_file)
        assert over_http.usage is not None and over_http.usage.completion_tokens == 3
        assert over_http.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
        tier = json.loads(structured_answer(config_file))  # xgrammar inside the worker actors
        assert set(tier) == {"tier"} and tier["tier"] in ("device", "host", "disk")
        stats = client.stats()
        assert {w.worker for w in stats.workers if w.healthy} == {"worker-0", "worker-1"}

        config = yaml.safe_load(config_file.read_text())["metrics"]
        first_tokens = 0.0
        for i, port in enumerate((config["worker_port"], config["worker_port"] + 1)):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            assert f'radixmesh_worker_running{{worker="worker-{i}"}}'.encode() in body
            for family in text_string_to_metric_families(body.decode()):
                if family.name == "radixmesh_worker_time_to_first_token_seconds":
                    counts = [s for s in family.samples if s.name.endswith("_count")]
                    assert [s.labels for s in counts] == [{"worker": f"worker-{i}"}]
                    first_tokens += counts[0].value
        # the workers timed the four calls above once each, and read_across_workers' three
        assert first_tokens == 4 + 3
        router_metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{config['router_port']}/metrics", timeout=10
        ).read()
        assert b'radixmesh_router_requests_total{status="OK"}' in router_metrics
        # two gRPC calls, one chat and one structured answer over HTTP: each timed once
        assert b"radixmesh_router_time_to_first_token_seconds_count 4.0" in router_metrics

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
        assert set(outcomes.values()) == {"length"}, outcomes  # the cut streams migrated

        def rejoined() -> bool:
            workers = {w.worker: w for w in client.stats().workers}
            return victim_name in workers and workers[victim_name].healthy

        wait_for(rejoined, 180, f"{victim_name} did not rejoin")
        assert ray_call(head, describe) != pid_before, "the worker was not restarted"

        kept = stored_response(config_file)
        batch_id = running_batch(config_file)
        ray_call(head, "ray.kill(actor('radixmesh-router'), no_restart=False)")
        before = journalled(config_file, batch_id)  # what the killed router had answered
        assert 1 <= len(before) < BATCH_LINES, before
        wait_serving(target)
        wait_for(
            lambda: len([w for w in client.stats().workers if w.healthy]) == 2,
            120,
            "workers did not return to the restarted router",
        )
        assert list(client.generate(text_request(PROMPT, max_tokens=3)))[-1].finished
        assert http_answer(config_file).choices[0].finish_reason == "length"  # the same port
        assert continued_response(config_file, kept) in ("completed", "incomplete")
        # the batch, in router.state_dir, went on in the restarted router: each line once,
        # in order, those answered before the kill not run again (the same request ids)
        after = batch_after_restart(config_file, batch_id)
        assert list(after) == [f"b{i}" for i in range(BATCH_LINES)]
        assert {k: after[k] for k in before} == before
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)
        stderr = serve.stderr.read()  # type: ignore[union-attr]
    assert code == 0, stderr[-3000:]
    assert "draining" in stderr and "stopped" in stderr
    # the router is given the workers' names: no handle puts its arguments in the object store
    assert "constructor arguments in the object store" not in stderr, stderr[-3000:]


def test_a_frozen_worker_is_routed_around_and_rejoins_when_it_wakes(
    head: dict[str, str], config_file: Path
) -> None:
    """A worker whose process stops answering without dying (SIGSTOP: a hung driver, a
    debugger, a livelock) keeps its sockets open, so no stream breaks. The router must notice
    (its Ray call to the actor times out), detach it and serve its prefix elsewhere, including
    a stream already sent to it; and take it back once it answers again."""
    with serving(head, config_file) as (_, target):
        client = Client(target)
        prompt = PROMPT + "frozen"
        victim = list(client.generate(text_request(prompt, max_tokens=4)))[-1].worker
        describe = f"print(ray.get(actor('radixmesh-{victim}').describe.remote())['pid'])"
        pid = int(ray_call(head, describe))
        os.kill(pid, signal.SIGSTOP)
        try:
            answers = []
            for _ in range(3):  # the prefix's home is the frozen worker: it is asked first
                began = time.monotonic()
                last = list(client.generate(text_request(prompt, max_tokens=4), timeout=60))[-1]
                answers.append((last.worker, last.finish_reason, time.monotonic() - began))
            assert all(worker != victim and reason == "length" for worker, reason, _ in answers)
            assert max(seconds for _, _, seconds in answers) < 30, answers
            healthy = {w.worker for w in client.stats().workers if w.healthy}
            assert victim not in healthy, healthy
        finally:
            os.kill(pid, signal.SIGCONT)

        def rejoined() -> bool:
            return victim in {w.worker for w in client.stats().workers if w.healthy}

        wait_for(rejoined, 120, f"{victim} did not rejoin once it woke")
        assert int(ray_call(head, describe)) == pid, "it was restarted, not woken"
        assert list(client.generate(text_request(prompt, max_tokens=3)))[-1].finished


def test_workers_a_cluster_cannot_hold_yet_are_waited_for_saying_so(
    head: dict[str, str], tmp_path: Path, tiny_model: Path
) -> None:
    """On a cluster of the user's, which an autoscaler may grow, serve places workers the
    cluster cannot hold now and waits, saying for what (the embedded cluster refuses them:
    tests/cluster/test_serve_resources.py)."""
    path = write_config(tmp_path, str(tiny_model))
    config = yaml.safe_load(path.read_text())
    config["workers"]["cpus_per_worker"] = 4  # 2 x 4 of the head's 6
    path.write_text(yaml.safe_dump(config))
    env = environment(head["token"], RAY_ADDRESS=head["address"])
    with (tmp_path / "serve.err").open("w") as err:
        serve = subprocess.Popen(
            [BIN / "radixmesh", "serve", "--config", str(path)],
            env=env, stdout=subprocess.DEVNULL, stderr=err, text=True,
        )  # fmt: skip
    try:
        wait_for(lambda: "waiting" in (tmp_path / "serve.err").read_text(), 120, "no line")
        said = (tmp_path / "serve.err").read_text()
        assert (
            "radixmesh serve: waiting for the Ray cluster to grow: 2 workers of 4 CPUs "
            "(workers.count, workers.cpus_per_worker) need 8 CPUs; the Ray cluster has 6"
        ) in said, said
        time.sleep(5)
        assert serve.poll() is None, "it waits"
    finally:
        serve.kill()
        serve.wait(timeout=60)
    # its actors die with it (the next serve on this head reuses their names)
    gone = "names = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)]\n"
    gone += "print(not any(n.startswith('radixmesh-') for n in names))"
    wait_for(lambda: ray_call(head, gone) == "True", 60, "its actors outlived it")


def test_ray_job_submit_runs_the_same_command(head: dict[str, str], config_file: Path) -> None:
    env = environment(head["token"])
    job = f"radixmesh-test-{os.getpid()}"
    submit = [
        BIN / "ray", "job", "submit", "--address", head["dashboard"], "--submission-id", job,
        "--working-dir", str(ROOT), "--runtime-env-json", STOP_WAIT, "--no-wait", "--",
        "radixmesh", "serve", "--config", str(config_file),
    ]  # fmt: skip
    for _ in range(30):  # the head's job agent registers after the dashboard answers
        submitted = subprocess.run(
            submit, env=env, timeout=180, capture_output=True, text=True, check=False
        )
        if "No available agent to submit job" not in submitted.stderr:
            break
        time.sleep(2)  # Ray's own advice: "please try again later"
    assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-3000:]
    target = endpoint(config_file)
    try:
        wait_serving(target)
        listening = listening_addresses(int(head["pid"]))
        answer = list(Client(target).generate(text_request(PROMPT, max_tokens=5)))[-1]
        assert answer.finished and answer.worker.startswith("worker-")
        # the README's recipe: the head, the job's driver (serve), its router and workers
        listening |= listening_addresses(int(head["pid"]))
        assert listening and listening <= LOOPBACK, listening
        # `ray job stop` (the README's way to end it) while a stream is under way: serve drains
        stream = Client(target).generate(text_request(PROMPT, max_tokens=400), timeout=120)
        first = next(stream)
    finally:
        subprocess.run(
            [BIN / "ray", "job", "stop", "--address", head["dashboard"], job],
            env=env, timeout=180, capture_output=True, check=False,
        )  # fmt: skip
    rest = list(stream)
    last = [first, *rest][-1]
    assert last.finished and last.finish_reason in ("length", "stop"), "the stream was cut"
    status = subprocess.run(
        [BIN / "ray", "job", "status", "--address", head["dashboard"], job],
        env=env, timeout=60, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "stopped" in status.stdout.lower() or "succeeded" in status.stdout.lower(), status.stdout
    logs = subprocess.run(
        [BIN / "ray", "job", "logs", "--address", head["dashboard"], job],
        env=env, timeout=60, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "draining" in logs.stdout and "\nstopped\n" in logs.stdout, logs.stdout[-3000:]


def test_the_cluster_refuses_a_process_without_its_token(
    head: dict[str, str], tmp_path: Path
) -> None:
    """Token authentication is on for the cluster itself, not only asked for by our clients."""
    other = create_token_file(tmp_path / "other-token")
    assert other.read_text() != Path(head["token"]).read_text()
    jobs = [str(BIN / "ray"), "job", "list", "--address", head["dashboard"]]
    refused = subprocess.run(
        jobs, env=environment(other), capture_output=True, text=True, timeout=120, check=False
    )
    assert refused.returncode != 0 and "token is invalid" in refused.stdout + refused.stderr
    allowed = subprocess.run(
        jobs,
        env=environment(head["token"]),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]

    driver = ray_process(head, "print('joined')", other)
    assert driver.returncode != 0 and "joined" not in driver.stdout
    assert "Unauthenticated" in driver.stderr, driver.stderr[-3000:]
    assert ray_call(head, "print('joined')") == "joined"


def test_a_router_killed_with_the_default_model_serves_again(
    head: dict[str, str], tmp_path: Path
) -> None:
    """kill -9 of the router process under load, with SmolLM2 (its tokenizer.json is 3.5 MB:
    a restart that needed it from Ray's object store failed for good). The port serves again
    within seconds and the index is rebuilt from the workers' snapshots: a prompt cached before
    the kill is routed to the worker that holds it."""
    config = write_config(tmp_path, "default")
    with serving(head, config) as (serve, target):
        client = Client(target)
        question = PROMPT * 4 + "What does the router remember?"
        warm = list(client.generate(text_request(question, max_tokens=2), timeout=120))[-1]
        outcomes: list[object] = []

        def load(i: int) -> None:
            request = text_request(f"{i}: {question}", max_tokens=64)
            request.sampling.ignore_eos = True  # still streaming when the router dies
            try:
                outcomes.append(
                    list(Client(target).generate(request, timeout=120))[-1].finish_reason
                )
            except grpc.RpcError as err:
                outcomes.append(err.code().name)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(2.0)
        os.kill(router_pid(head), signal.SIGKILL)
        killed = time.monotonic()
        wait_serving(target, timeout=120)
        recovered_s = time.monotonic() - killed
        for thread in threads:
            thread.join(timeout=180)
        assert len(outcomes) == 3  # streams through the dead router may fail; none may hang
        print(f"router back {recovered_s:.1f} s after kill -9; in flight: {outcomes}")
        wait_for(
            lambda: len([w for w in client.stats().workers if w.healthy]) == 2,
            60,
            "workers did not return to the restarted router",
        )
        again = list(client.generate(text_request(question, max_tokens=2), timeout=120))[-1]
        assert again.worker == warm.worker and again.predicted_cached_tokens > 0
        assert again.cached_prompt_tokens > 0
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=120) == 0, serve.stderr.read()[-3000:]  # type: ignore[union-attr]


def test_a_router_ray_cannot_restart_ends_serve_with_one_line(
    head: dict[str, str], tmp_path: Path, tiny_model: Path
) -> None:
    config = write_config(tmp_path, str(tiny_model), max_restarts=0)
    with serving(head, config) as (serve, target):
        wait_serving(target)
        os.kill(router_pid(head), signal.SIGKILL)
        code = serve.wait(timeout=120)
        stderr = serve.stderr.read()  # type: ignore[union-attr]
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "the router died for good" in stderr and "the workers were drained" in stderr
    gone = ray_process(head, "actor('radixmesh-worker-0')", head["token"])
    assert gone.returncode != 0, "the workers outlived serve"


def test_a_stop_signal_with_the_router_dead_still_drains_the_workers(
    head: dict[str, str], tmp_path: Path, tiny_model: Path
) -> None:
    config = write_config(tmp_path, str(tiny_model), max_restarts=0)
    with serving(head, config) as (serve, target):
        wait_serving(target)
        ray_call(head, "ray.kill(actor('radixmesh-router'), no_restart=True)")
        serve.send_signal(signal.SIGINT)
        code = serve.wait(timeout=120)
        stderr = serve.stderr.read()  # type: ignore[union-attr]
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "the workers were drained, the router was dead" in stderr


@contextlib.contextmanager
def a_taken_port() -> Iterator[int]:
    """A loopback port something else listens on, for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def run_serve(head: dict[str, str], config: Path) -> subprocess.CompletedProcess[str]:
    env = environment(head["token"], RAY_ADDRESS=head["address"])
    return subprocess.run(
        [BIN / "radixmesh", "serve", "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_a_worker_that_cannot_load_its_model_ends_serve_with_one_line(
    head: dict[str, str], tmp_path: Path
) -> None:
    """The model is read where the workers run, so only a worker can find it missing: serve
    names the worker and its error in one line (it was a traceback)."""
    missing = tmp_path / "no-such-model"
    out = run_serve(head, write_config(tmp_path, str(missing)))
    assert out.returncode == 1, out.stderr[-3000:]
    error = f"worker.checkpoint.CheckpointError: model '{missing}'"
    assert f"radixmesh serve: worker-0 could not start: {error}" in out.stderr, out.stderr[-3000:]
    assert not any(text.startswith("Traceback") for text in out.stderr.splitlines())


def test_a_router_port_already_taken_ends_serve_with_one_line(
    head: dict[str, str], tmp_path: Path, tiny_model: Path
) -> None:
    with a_taken_port() as port:
        out = run_serve(head, write_config(tmp_path, str(tiny_model), port=port))
    assert out.returncode == 1, out.stderr[-3000:]
    error = f"RuntimeError: Failed to bind to address 127.0.0.1:{port}"
    assert f"radixmesh serve: the router could not start: {error}" in out.stderr, out.stderr
    assert not any(text.startswith("Traceback") for text in out.stderr.splitlines())


def test_a_failed_start_kills_what_it_placed(
    head: dict[str, str], tmp_path: Path, tiny_model: Path
) -> None:
    """In a driver that lives on (serve's own exit takes its actors with it): the workers
    started, the router did not, and none of the three is left. The driver keeps the workers'
    handles (Ray would end an actor whose last handle is dropped), so only `start`'s kills can
    end them."""
    with a_taken_port() as port:
        config = write_config(tmp_path, str(tiny_model), port=port)
        out = ray_call(head, START_THEN_LOOK.format(config=str(config)))
    lines = out.splitlines()
    assert lines[0].startswith("StartFailed: the router could not start: RuntimeError"), out
    assert lines[1:] == [f"gone {name}" for name in ACTORS], out


ACTORS = ("radixmesh-router", "radixmesh-worker-0", "radixmesh-worker-1")
START_THEN_LOOK = (
    """
import time
import cluster.serve
from cluster.config import ClusterConfig
from cluster.serve import StartFailed, start
kept = []
place_router = cluster.serve.place_router
def keeping(config, workers):  # the workers' handles outlive start: only its kills end them
    kept.append(dict(workers))
    return place_router(config, workers)
cluster.serve.place_router = keeping
try:
    start(ClusterConfig.load({config!r}))
except StartFailed as err:
    print("StartFailed:", err)
for name in """
    + repr(ACTORS)
    + """:
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get_actor(name)
        except ValueError as err:  # Ray has no live actor of that name
            print("gone", name)
            break
        if time.monotonic() > deadline:
            print("alive", name)
            break
        time.sleep(0.5)
"""
)
