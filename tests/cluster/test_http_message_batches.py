"""Anthropic's Message Batches API (cluster/http/message_batches.py) on a local cluster of two
tiny-model workers, through the `anthropic` SDK: each request is answered as the same request
sent to /v1/messages would be; a request /v1/messages refuses is its `errored` result and the
others run; requests are checked by name when the batch is created; a cancel ends the requests
running and the rest are `canceled`; batches list newest first in Anthropic's pages, apart from
OpenAI's batches and files; an ended batch is deleted with its files; under the `priority`
policy a batch yields to interactive requests; and with `router.state_dir` a batch goes on
after a restart."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx
import openai
import pytest

from cluster.config import RouterSection
from cluster.http import batches
from cluster.http.batch_schema import MESSAGES, read_lines
from cluster.http.message_batches import requests_file
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_http_batches import SYSTEMS
from tests.cluster.test_http_batches_restart import started_again, stopped
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def sdk(cluster: LocalCluster) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[anthropic.Anthropic]:
    with sdk(cluster) as c:
        yield c


def params(system: str, question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    body = {"model": SERVED_NAME, "system": system, "messages": messages, "max_tokens": 6}
    return body | {"temperature": 0} | extra


def greedy(client: anthropic.Anthropic, sent: dict[str, Any]) -> Any:
    """`sent` as a message's request (the SDK takes `temperature` only as an extra)."""
    temperature = sent.pop("temperature")
    return client.messages.create(**sent, extra_body={"temperature": temperature})


def ended(client: anthropic.Anthropic, batch_id: str, within_s: float = 60) -> Any:
    deadline = time.monotonic() + within_s
    while (batch := client.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.processing_status}"
        time.sleep(0.05)
    return batch


def results(client: anthropic.Anthropic, batch_id: str) -> dict[str, Any]:
    return {r.custom_id: r.result for r in client.messages.batches.results(batch_id)}


def running(cluster: LocalCluster, client: anthropic.Anthropic, count: int, answered: int) -> str:
    """A batch of `count` long requests, once `answered` of them have been."""
    requests = [
        {"custom_id": f"l{i}", "params": params(SYSTEMS[i % 2], f"Talk {i}.", max_tokens=300)}
        for i in range(count)
    ]
    batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert cluster.http is not None
    kept = cluster.http.api.batches
    deadline = time.monotonic() + 60
    while kept.get("", batch.id, messages=True).request_counts.completed < answered:
        assert time.monotonic() < deadline, f"fewer than {answered} answered"
        time.sleep(0.02)
    return batch.id


def test_each_request_is_answered_as_messages_answers_it(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    questions = [(SYSTEMS[i % 2], f"Question {i}?") for i in range(6)]  # the systems interleaved
    requests = [{"custom_id": f"q{i}", "params": params(*q)} for i, q in enumerate(questions)]
    batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert batch.type == "message_batch" and batch.id.startswith("msgbatch_")
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 6 and batch.request_counts.succeeded == 0
    assert (batch.expires_at - batch.created_at).total_seconds() == 24 * 3600
    done = ended(client, batch.id)
    counts = done.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled) == (0, 6, 0, 0)
    assert done.ended_at is not None and done.results_url is not None
    # a path, read from the address the SDK calls (behind a proxy too)
    assert done.results_url == f"/v1/messages/batches/{batch.id}/results"
    got = list(client.messages.batches.results(batch.id))
    assert [r.custom_id for r in got] == [f"q{i}" for i in range(6)]  # the order sent
    cached = 0
    for (system, question), result in zip(questions, got, strict=True):
        assert result.result.type == "succeeded"
        message = result.result.message
        alone = greedy(client, params(system, question))
        assert message.content == alone.content and message.stop_reason == alone.stop_reason
        cached += message.usage.cache_read_input_tokens or 0
    assert cached > 0  # a system prompt read from the cache
    assert_no_leak(cluster)


def test_a_refused_request_is_its_errored_result_and_the_others_run(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    requests = [
        {"custom_id": "good", "params": params(SYSTEMS[0], "Hi?")},
        {"custom_id": "bad", "params": params(SYSTEMS[0], "Hi?", temperature=3)},
        {"custom_id": "nomodel", "params": params(SYSTEMS[0], "Hi?", model="gpt-9")},
    ]
    batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    counts = ended(client, batch.id).request_counts
    assert (counts.succeeded, counts.errored) == (1, 2)
    got = results(client, batch.id)
    assert got["good"].type == "succeeded"
    assert got["bad"].type == "errored"
    assert got["bad"].error.error.type == "invalid_request_error"
    assert "temperature" in got["bad"].error.error.message
    assert got["nomodel"].error.error.type == "not_found_error"
    assert "'gpt-9' does not exist" in got["nomodel"].error.error.message
    assert_no_leak(cluster)


@pytest.mark.parametrize(
    ("requests", "named"),
    [
        ([], "requests: holds 0 requests; from 1 to 100000"),
        ([{"custom_id": "a b", "params": {}}], "requests[0].custom_id: must be 1-64 letters"),
        ([{"custom_id": "x" * 65, "params": {}}], "requests[0].custom_id: must be 1-64"),
        (
            [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}],
            "requests[1].custom_id: 'a' is requests[0]'s too",
        ),
        ([{"custom_id": "a", "params": []}], "requests[0].params: must be an object"),
        (
            [{"custom_id": "a", "params": {"stream": True}}],
            "requests[0].params.stream: a batch request cannot stream",
        ),
        ([{"custom_id": "a", "params": {}, "x": 1}], "requests[0].x: is not a field"),
        (
            [{"custom_id": "a", "params": {}}, {"custom_id": "b", "params": {"background": True}}],
            "requests[1].params.background: a batch request cannot run in the background",
        ),
    ],
)
def test_creating_refuses_bad_requests_by_name(
    client: anthropic.Anthropic, cluster: LocalCluster, requests: list[Any], named: str
) -> None:
    assert cluster.http is not None
    held = cluster.http.api.files.held
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.batches.create(requests=requests)
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert named in refused.value.message
    assert cluster.http.api.files.held == held  # nothing kept


def test_a_cancel_ends_the_requests_running_and_cancels_the_rest(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    batch_id = running(cluster, client, 30, 1)
    canceling = client.messages.batches.cancel(batch_id)
    assert canceling.processing_status in ("canceling", "ended")
    assert canceling.cancel_initiated_at is not None
    done = ended(client, batch_id)
    counts = done.request_counts
    assert counts.succeeded >= 1 and counts.canceled >= 1 and counts.errored == 0
    assert counts.succeeded + counts.canceled == 30
    got = results(client, batch_id)
    assert list(got) == [f"l{i}" for i in range(30)]
    assert sum(r.type == "canceled" for r in got.values()) == counts.canceled
    succeeded = [r.message for r in got.values() if r.type == "succeeded"]
    assert all(m.usage.output_tokens == 300 for m in succeeded)
    assert_no_leak(cluster)  # the requests running were ended, their pages freed


def test_batches_list_newest_first_apart_from_openais(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    made = []
    for i in range(3):
        requests = [{"custom_id": "only", "params": params(SYSTEMS[0], f"List {i}?")}]
        made.append(client.messages.batches.create(requests=requests).id)  # type: ignore[arg-type]
    listed = [b.id for b in client.messages.batches.list(limit=2)]  # the SDK pages on
    assert listed[:3] == made[::-1]
    page = client.messages.batches.list(limit=1, before_id=made[0])
    assert [b.id for b in page.data] == [made[1]] and page.has_more
    page = client.messages.batches.list(limit=5, after_id=made[1])
    assert page.data[0].id == made[0]
    with pytest.raises(anthropic.BadRequestError, match="after_id"):
        client.messages.batches.list(after_id="msgbatch_none")
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as oa:
        assert not set(made) & {b.id for b in oa.batches.list()}
        with pytest.raises(openai.NotFoundError):
            oa.batches.retrieve(made[0])
        purposes = {f.purpose for f in oa.files.list()}
        assert "message_batch" not in purposes  # its requests and results are not files
        for batch_id in made:
            ended(client, batch_id)
            kept = cluster.http.api.batches.get("", batch_id, messages=True)  # type: ignore[union-attr]
            with pytest.raises(openai.NotFoundError):
                oa.files.content(kept.input_file_id)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("batch_none")


def test_a_client_deleting_what_it_pages_through_pages_on(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    """The SDK asks for the page after the last batch it read, which the loop has just deleted:
    the listing goes on from where that batch stood, in both directions."""
    made = []
    for i in range(4):
        requests = [{"custom_id": "only", "params": params(SYSTEMS[1], f"Paged {i}?")}]
        made.append(client.messages.batches.create(requests=requests).id)  # type: ignore[arg-type]
    for batch_id in made:
        ended(client, batch_id)
    client.messages.batches.delete(made[1])
    page = client.messages.batches.list(limit=1, before_id=made[1])  # newer than it stood
    assert [b.id for b in page.data] == [made[2]] and page.has_more
    page = client.messages.batches.list(limit=1, after_id=made[1])  # older
    assert [b.id for b in page.data] == [made[0]]
    seen = []
    for batch in client.messages.batches.list(limit=1):
        seen.append(batch.id)
        if batch.id in made:
            client.messages.batches.delete(batch.id)
    assert [each for each in seen if each in made] == [made[3], made[2], made[0]]
    assert not set(made) & {b.id for b in client.messages.batches.list()}
    with pytest.raises(anthropic.BadRequestError, match="before_id"):
        client.messages.batches.list(before_id="msgbatch_none")
    assert cluster.http is not None
    cluster.http.api.batches.places.add("", "batch_openais")  # as OpenAI's batch API keeps one
    with pytest.raises(anthropic.BadRequestError, match="after_id"):  # listed apart
        client.messages.batches.list(after_id="batch_openais")
    cluster.http.api.batches.places.remove("", "batch_openais")
    assert_no_leak(cluster)


def test_an_ended_batch_is_deleted_with_its_files(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    assert cluster.http is not None
    held = cluster.http.api.files.held
    batch_id = running(cluster, client, 6, 0)
    with pytest.raises(anthropic.BadRequestError, match="cancel it first"):
        client.messages.batches.delete(batch_id)
    early = httpx.get(f"{cluster.http_url}/v1/messages/batches/{batch_id}/results", timeout=10)
    assert early.status_code == 400 and "still processing" in early.json()["error"]["message"]
    client.messages.batches.cancel(batch_id)
    ended(client, batch_id)
    assert cluster.http.api.files.held > held  # its requests and results
    gone = client.messages.batches.delete(batch_id)
    assert (gone.id, gone.type) == (batch_id, "message_batch_deleted")
    assert cluster.http.api.files.held == held
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch_id)
    assert batch_id not in {b.id for b in client.messages.batches.list()}
    assert_no_leak(cluster)


def test_under_the_priority_policy_a_batch_yields_to_interactive_requests(
    tiny: LoadedModel,
) -> None:
    """One running slot, a batch of long requests in it: an interactive request (priority 0)
    preempts the batch's (router.batch_priority 1, which /v1/messages takes as vLLM's
    `priority`) and is answered before it ends."""
    engine = replace(ENGINE, scheduling_policy="priority", max_running=1)
    cluster = start_cluster(tiny, workers=1, http=True, engine=engine)
    try:
        client = sdk(cluster)
        (worker,) = cluster.engines.values()
        requests = [
            {"custom_id": f"b{i}", "params": params(SYSTEMS[0], f"B{i}.", max_tokens=300)}
            for i in range(2)
        ]
        batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        deadline = time.monotonic() + 60
        while worker.stats().running < 1 or worker.stats().generated_tokens < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        answer = greedy(client, params(SYSTEMS[1], "Now?", max_tokens=2))
        assert answer.stop_reason == "max_tokens"
        assert client.messages.batches.retrieve(batch.id).processing_status == "in_progress"
        assert worker.stats().preemptions >= 1
        assert ended(client, batch.id).request_counts.succeeded == 2
    finally:
        cluster.close()


def test_a_running_batch_goes_on_after_a_restart(tiny: LoadedModel, tmp_path: Path) -> None:
    router = RouterSection(port=0, state_dir=str(tmp_path / "state"), batch_max_in_flight=2)
    cluster = start_cluster(tiny, http=True, router=router, engine=ENGINE)
    try:
        client = sdk(cluster)
        requests = [
            {"custom_id": f"r{i}", "params": params(SYSTEMS[i % 2], f"Say {i}.", max_tokens=40)}
            for i in range(10)
        ]
        batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        assert cluster.http is not None
        kept = cluster.http.api.batches
        deadline = time.monotonic() + 60
        while kept.get("", batch.id, messages=True).request_counts.completed < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        stopped(cluster)
        started_again(cluster)
        client = sdk(cluster)
        assert client.messages.batches.retrieve(batch.id).processing_status == "in_progress"
        done = ended(client, batch.id)
        assert done.request_counts.succeeded == 10
        got = results(client, batch.id)
        assert list(got) == [f"r{i}" for i in range(10)]
        assert all(
            r.type == "succeeded" and r.message.usage.output_tokens == 40 for r in got.values()
        )
        state = tmp_path / "state"
        client.messages.batches.delete(batch.id)  # gone from the directory too
        assert not [p for p in (state / "batches").iterdir() if batch.id in p.name]
        assert not [p for p in (state / "files").iterdir() if p.suffix == ".bin"]
        # what nothing refers to: a journal without its object, a batch's file without it
        (state / "batches" / "msgbatch_gone.answers.jsonl").write_text("{}\n")
        assert cluster.http is not None
        card = cluster.http.api.files.keep("", "stray.jsonl", batches.INPUT_PURPOSE, b"{}\n")
        cluster.loop.run(cluster.http.api.files.save("", card.id))
        assert (state / "files" / f"{card.id}.bin").exists()
        stopped(cluster)
        started_again(cluster)
        assert not (state / "batches" / "msgbatch_gone.answers.jsonl").exists()
        assert cluster.http.api.files.find("", card.id) is None
        assert not (state / "files" / f"{card.id}.bin").exists()
        assert_no_leak(cluster)
    finally:
        cluster.close()


def test_a_create_may_be_as_large_as_an_upload(
    client: anthropic.Anthropic, cluster: LocalCluster
) -> None:
    """Past router.max_message_bytes (4 MiB), as an upload to /v1/files may be: the batch is
    made, and its request too large for /v1/messages is that request's refusal."""
    assert cluster.http is not None
    big = cluster.config.router.max_message_bytes + 1000
    requests = [
        {"custom_id": "big", "params": params(SYSTEMS[0], "x" * big)},
        {"custom_id": "small", "params": params(SYSTEMS[0], "Small?")},
    ]
    batch = client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    counts = ended(client, batch.id).request_counts
    assert (counts.succeeded, counts.errored) == (1, 1)
    got = results(client, batch.id)
    assert got["big"].error.error.type == "request_too_large"
    client.messages.batches.delete(batch.id)
    assert_no_leak(cluster)


def test_a_forgotten_batch_takes_its_files_and_they_stay_apart_from_openais(
    client: anthropic.Anthropic, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the ended batches kept, the oldest Message Batch is forgotten with its requests and
    results, which nothing else reaches; OpenAI's batch API cannot name those files either."""
    assert cluster.http is not None
    api = cluster.http.api
    first = client.messages.batches.create(
        requests=[{"custom_id": "a", "params": params(SYSTEMS[0], "First?")}]  # type: ignore[list-item]
    )
    kept = api.batches.get("", ended(client, first.id).id, messages=True)
    oa = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)
    with oa, pytest.raises(openai.NotFoundError):
        oa.batches.create(
            input_file_id=kept.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    order = [k for k, r in api.batches._batches.items() if r.batch.status in batches.ENDED]
    # one more ended batch forgets every one up to the first
    monkeypatch.setattr(batches, "MAX_ENDED", len(order) - order.index(("", first.id)))
    second = client.messages.batches.create(
        requests=[{"custom_id": "b", "params": params(SYSTEMS[0], "Second?")}]  # type: ignore[list-item]
    )
    ended(client, second.id)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(first.id)
    for file_id in (kept.input_file_id, kept.output_file_id):
        assert file_id is not None and api.files.find("", file_id) is None
    assert_no_leak(cluster)


def test_the_requests_are_kept_as_the_lines_they_are_read_back_as() -> None:
    """A batch runs the lines it was created with, and after a restart the lines read back from
    its requests file: the two are the same."""
    requests = [
        {"custom_id": f"r{i}", "params": params(SYSTEMS[i % 2], f"Q{i} \u2028 é")} for i in range(5)
    ]
    content, lines = requests_file(requests)
    assert read_lines(content, MESSAGES) == (lines, [])
