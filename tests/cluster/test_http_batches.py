"""OpenAI's Files and Batch APIs (cluster/http/batches.py) on a local cluster of two tiny-model
workers, through the `openai` SDK: each request of a batch is answered as the same request sent
to its endpoint would be, in the input's order; a refused request is its line in the error file
and the others run; a file that is not a batch's requests fails the batch naming each line at
fault; a cancel ends the requests running and keeps what was answered; a worker killed under a
batch costs it nothing; files and batches are their tenant's; and the prefix order serves more
of the prompts from cache than the file's order."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.config import RouterSection, SecuritySection
from cluster.http.batch_schema import BatchLine, prefix_order, prompt_key
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
CHAT = "/v1/chat/completions"
SYSTEMS = ["You answer in one word. " * 6, "You answer at length, citing sources. " * 5]


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def sdk(cluster: LocalCluster, token: str = "none") -> openai.OpenAI:
    """The SDK on a cluster a test started (closed with the cluster's HTTP server)."""
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=token, max_retries=0)


def line(custom_id: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, **extra}


def upload(client: openai.OpenAI, lines: Sequence[dict[str, Any] | str]) -> str:
    # as most writers of JSON Lines write them: unescaped, so a U+2028 in a text stays one
    rows = (x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in lines)
    text = "\n".join(rows) + "\n"
    return client.files.create(file=("requests.jsonl", text.encode()), purpose="batch").id


def upload_anyway(cluster: LocalCluster, lines: Sequence[dict[str, Any]]) -> str:
    """A batch file put in the store past its bound (as a batch's output is)."""
    assert cluster.http is not None
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return cluster.http.api.files.keep("", "late.jsonl", "batch", content).id


def finished(client: openai.OpenAI, batch_id: str, within_s: float = 60) -> Any:
    deadline = time.monotonic() + within_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status}"
        time.sleep(0.05)


def started(client: openai.OpenAI, lines: Sequence[dict[str, Any]], answered: int) -> str:
    """A chat batch's id, once `answered` of its requests have been."""
    file_id = upload(client, lines)
    batch = client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < answered:
        assert time.monotonic() < deadline, f"fewer than {answered} answered"
        time.sleep(0.02)
    return batch.id


def run(client: openai.OpenAI, lines: Sequence[dict[str, Any]], endpoint: str = CHAT) -> Any:
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    assert batch.status == "in_progress" and batch.request_counts.total == len(lines)
    return finished(client, batch.id)


def answers(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_each_request_is_answered_as_its_endpoint_answers_it_in_the_inputs_order(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    questions = [(SYSTEMS[i % 2], f"Question {i}?") for i in range(8)]  # the systems interleaved
    lines = [line(f"q{i}", chat(s, q)) for i, (s, q) in enumerate(questions)]
    batch = run(client, lines)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (8, 0)
    out = answers(client, batch.output_file_id)
    assert [a["custom_id"] for a in out] == [f"q{i}" for i in range(8)]
    prompt = completion = cached = 0
    for (system, question), answer in zip(questions, out, strict=True):
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        assert answer["response"]["request_id"] == answer["id"]
        body = answer["response"]["body"]
        assert body["object"] == "chat.completion" and body["id"].endswith(answer["id"])
        alone = client.chat.completions.create(**chat(system, question))
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        prompt += body["usage"]["prompt_tokens"]
        completion += body["usage"]["completion_tokens"]
        cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
    usage = batch.usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt, completion)
    assert usage.total_tokens == prompt + completion
    assert usage.input_tokens_details.cached_tokens == cached > 0
    assert_no_leak(cluster)


def test_completions_and_embeddings_run_as_batches_too(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    prompts = [[*range(30, 60), i] for i in range(4)]
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    done = run(
        client,
        [line(f"c{i}", {**body, "prompt": p}, "/v1/completions") for i, p in enumerate(prompts)],
        "/v1/completions",
    )
    texts = [
        a["response"]["body"]["choices"][0]["text"] for a in answers(client, done.output_file_id)
    ]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0)
        for p in prompts
    ]
    assert texts == [a.choices[0].text for a in alone]
    embedded = run(
        client,
        [
            line(f"e{i}", {"model": MODEL, "input": p}, "/v1/embeddings")
            for i, p in enumerate(prompts)
        ],
        "/v1/embeddings",
    )
    vectors = [
        a["response"]["body"]["data"][0]["embedding"]
        for a in answers(client, embedded.output_file_id)
    ]
    direct = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    for got, want in zip(vectors, direct.data, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want.embedding, strict=True)) < 1e-5
    assert embedded.usage.output_tokens == 0 and embedded.usage.input_tokens == 4 * 31
    assert_no_leak(cluster)


def test_a_refused_request_is_its_line_in_the_error_file_and_the_others_run(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    lines = [
        line("fine", chat(SYSTEMS[0], "Fine?")),
        line("too-long", chat(SYSTEMS[0], "Too long?", max_tokens=10**6)),
        line("unknown", chat(SYSTEMS[0], "Unknown?", temperature_x=1)),
        line("fine-too", chat(SYSTEMS[1], "Fine\u2028too?")),  # a line separator, not a line end
    ]
    batch = run(client, lines)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 2)
    assert [a["custom_id"] for a in answers(client, batch.output_file_id)] == ["fine", "fine-too"]
    errors = {a["custom_id"]: a["response"] for a in answers(client, batch.error_file_id)}
    assert list(errors) == ["too-long", "unknown"]
    assert errors["too-long"]["status_code"] == 400
    assert errors["too-long"]["body"]["error"]["param"] == "max_tokens"
    assert errors["unknown"]["status_code"] == 400
    assert "temperature_x" in errors["unknown"]["body"]["error"]["message"]
    assert_no_leak(cluster)


def test_a_file_that_is_not_a_batchs_requests_fails_the_batch_naming_each_line(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    routed = cluster.service.counters.routed
    lines: list[dict[str, Any] | str] = [
        line("ok", chat(SYSTEMS[0], "Fine?")),
        "{not json",
        line("other", chat(SYSTEMS[0], "Other?"), url="/v1/completions"),
        line("ok", chat(SYSTEMS[0], "Again?")),
        "",  # a blank line is skipped
        line("streams", chat(SYSTEMS[0], "Stream?", stream=True)),
        {"custom_id": "extra", "method": "POST", "url": CHAT, "body": {}, "header": 1},
        line("behind", chat(SYSTEMS[0], "Later?", background=True)),
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None
    got = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert got == [
        (2, "invalid_json_line", None),
        (3, "mismatched_url", "url"),
        (4, "duplicate_custom_id", "custom_id"),
        (6, "invalid_request", "body.stream"),
        (7, "invalid_request", "header"),
        (8, "invalid_request", "body.background"),
    ]
    assert batch.errors.data[2].message == "line 4: custom_id 'ok' is line 1's too"
    assert cluster.service.counters.routed == routed  # nothing ran


def test_creating_a_batch_refuses_what_it_cannot_run_by_name(client: openai.OpenAI) -> None:
    good = upload(client, [line("a", chat(SYSTEMS[0], "A?"))])
    with pytest.raises(openai.NotFoundError, match="no file 'file-nope'"):
        client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint: must be one of"):
        client.batches.create(
            input_file_id=good,
            endpoint="/v1/images/generations",  # type: ignore[arg-type]
            completion_window="24h",
        )
    with pytest.raises(openai.BadRequestError, match="completion_window: must be '24h'"):
        client.batches.create(
            input_file_id=good,
            endpoint=CHAT,
            completion_window="1h",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.NotFoundError, match="no batch 'batch_nope'"):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="metadata: 17 pairs; at most 16"):
        client.batches.create(
            input_file_id=good,
            endpoint=CHAT,
            completion_window="24h",
            metadata={f"k{i}": "v" for i in range(17)},
        )
    output = run(client, [line("a", chat(SYSTEMS[0], "A?"))]).output_file_id
    with pytest.raises(openai.BadRequestError, match="is a 'batch_output' file"):
        client.batches.create(input_file_id=output, endpoint=CHAT, completion_window="24h")


def test_files_are_listed_read_and_deleted(client: openai.OpenAI) -> None:
    content = json.dumps(line("a", chat(SYSTEMS[0], "A?"))).encode()
    card = client.files.create(file=("mine.jsonl", content), purpose="batch")
    assert (card.filename, card.bytes, card.purpose, card.object) == (
        "mine.jsonl", len(content), "batch", "file",
    )  # fmt: skip
    assert client.files.retrieve(card.id) == card
    assert client.files.content(card.id).content == content
    assert card.id in [f.id for f in client.files.list(purpose="batch")]
    assert card.id not in [f.id for f in client.files.list(purpose="batch_output")]
    assert client.files.delete(card.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(card.id)
    with pytest.raises(openai.BadRequestError, match="purpose: must be one of"):
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")


def test_a_client_deleting_the_files_it_pages_through_pages_on(client: openai.OpenAI) -> None:
    """`for f in client.files.list(): client.files.delete(f.id)`: the SDK asks for the page
    after the file it just deleted, and the listing goes on from where that file stood."""
    mine = [client.files.create(file=(f"d{i}.jsonl", b"{}"), purpose="batch").id for i in range(4)]
    for order in ("asc", "desc"):
        listed = [f.id for f in client.files.list(purpose="batch", order=order)]
        client.files.delete(mine[1])
        after = [f.id for f in client.files.list(purpose="batch", order=order, after=mine[1])]
        assert after == listed[listed.index(mine[1]) + 1 :]
        mine[1] = client.files.create(file=("again.jsonl", b"{}"), purpose="batch").id
    seen = []
    for card in client.files.list(purpose="batch", limit=1):
        seen.append(card.id)
        if card.id in mine:
            client.files.delete(card.id)
    # newest first: mine[1] was made again last
    assert [each for each in seen if each in mine] == [mine[1], mine[3], mine[2], mine[0]]
    assert not set(mine) & {f.id for f in client.files.list()}
    with pytest.raises(openai.BadRequestError, match="after"):
        client.files.list(after="file-none")


def test_a_cancel_ends_the_requests_running_and_keeps_what_was_answered(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    lines = [
        line(f"l{i}", chat(SYSTEMS[i % 2], f"Talk {i}.", max_tokens=300, ignore_eos=True))
        for i in range(40)
    ]
    batch_id = started(client, lines, 1)
    cancelling = client.batches.cancel(batch_id)
    assert cancelling.status in ("cancelling", "cancelled")
    ended = finished(client, batch_id)
    assert ended.status == "cancelled" and ended.cancelled_at is not None
    kept = answers(client, ended.output_file_id)
    assert 1 <= len(kept) == ended.request_counts.completed < 40
    assert all(a["response"]["body"]["usage"]["completion_tokens"] == 300 for a in kept)
    assert_no_leak(cluster)  # the requests running were ended, their pages freed


def test_a_worker_killed_under_a_batch_costs_it_nothing(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, http=True)
    try:
        client = sdk(cluster)
        lines = [
            line(f"k{i}", chat(SYSTEMS[i % 2], f"Go on {i}.", max_tokens=60, ignore_eos=True))
            for i in range(16)
        ]
        batch_id = started(client, lines, 2)
        cluster.kill_worker("worker-0")
        ended = finished(client, batch_id)
        assert ended.status == "completed" and ended.error_file_id is None
        assert ended.request_counts.completed == 16
        assert {a["custom_id"] for a in answers(client, ended.output_file_id)} == {
            f"k{i}" for i in range(16)
        }
    finally:
        cluster.close()


def test_files_and_batches_are_their_tenants(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = {"acme-token": "acme", "globex-token": "globex", "admin-token": "*"}
    # a small body bound: a body just past it fits the sockets' buffers, so the client reads
    # the early 413 instead of racing the server's close while it still sends
    router = RouterSection(port=0, max_message_bytes=1 << 16)
    security = SecuritySection(auth_tokens=tokens)
    cluster = start_cluster(tiny, http=True, router=router, security=security)
    try:
        acme, globex = sdk(cluster, "acme-token"), sdk(cluster, "globex-token")
        file_id = upload(acme, [line("a", chat(SYSTEMS[0], "Mine?"))])
        with pytest.raises(openai.NotFoundError):
            globex.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            globex.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        batch = finished(
            acme,
            acme.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id,
        )
        assert batch.status == "completed" and batch.request_counts.completed == 1
        with pytest.raises(openai.NotFoundError):
            globex.batches.retrieve(batch.id)
        assert [b.id for b in globex.batches.list()] == []
        assert [b.id for b in acme.batches.list()] == [batch.id]
        with pytest.raises(openai.AuthenticationError):
            sdk(cluster, "wrong").files.list()
        # an upload's size is allowed only to a known token: a stranger's body is bounded as
        # any request's is, and refused before it is read past that
        big = b"x" * (80 << 10)  # past router.max_message_bytes (64 KiB)
        with pytest.raises(openai.APIStatusError, match=r"router\.max_message_bytes") as refused:
            sdk(cluster, "wrong").files.create(file=("big.jsonl", big), purpose="batch")
        assert refused.value.status_code == 413
        assert acme.files.create(file=("big.jsonl", big), purpose="batch").bytes == len(big)
        # an ended batch keeps no credentials
        assert all(not kept.headers for kept in cluster.http.api.batches._batches.values())  # type: ignore[union-attr]
        # past the ended batches kept, globex's own oldest is forgotten, not acme's older one
        monkeypatch.setattr("cluster.http.batches.MAX_ENDED", 2)
        theirs = [
            finished(
                globex,
                globex.batches.create(
                    input_file_id=upload(globex, [line(f"g{i}", chat(SYSTEMS[0], f"G{i}?"))]),
                    endpoint=CHAT,
                    completion_window="24h",
                ).id,
            ).id
            for i in range(2)
        ]
        assert acme.batches.retrieve(batch.id).status == "completed"
        assert [b.id for b in globex.batches.list()] == theirs[1:]
    finally:
        cluster.close()


def test_one_tenants_files_cannot_fill_the_files_for_another(tiny: LoadedModel) -> None:
    """router.files_bytes_per_tenant: acme's upload past its share is refused naming it, and
    once its batch's output takes its share no batch of its starts; globex's still do."""
    tokens = {"acme-token": "acme", "globex-token": "globex"}
    router = RouterSection(port=0, files_bytes=1 << 20, files_bytes_per_tenant=3000)
    security = SecuritySection(auth_tokens=tokens)
    cluster = start_cluster(tiny, workers=1, http=True, router=router, security=security)
    try:
        acme, globex = sdk(cluster, "acme-token"), sdk(cluster, "globex-token")
        with pytest.raises(openai.APIStatusError, match=r"files_bytes_per_tenant") as refused:
            acme.files.create(file=("big.jsonl", b"x" * 3000), purpose="batch")
        assert refused.value.status_code == 413
        lines = [line(f"a{i}", chat(SYSTEMS[0], f"Q{i}?")) for i in range(6)]
        batch = run(acme, lines)  # its input fits; input and output together pass the share
        assert batch.status == "completed" and batch.output_file_id is not None
        with pytest.raises(openai.BadRequestError, match=r"files_bytes_per_tenant"):
            acme.batches.create(
                input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"
            )
        assert run(globex, lines).status == "completed"  # another tenant's share is its own
        acme.files.delete(batch.output_file_id)  # room made: acme's batches start again
        assert (
            finished(
                acme,
                acme.batches.create(
                    input_file_id=batch.input_file_id, endpoint=CHAT, completion_window="24h"
                ).id,
            ).status
            == "completed"
        )
    finally:
        cluster.close()


def test_an_upload_past_the_bound_is_refused_naming_it(tiny: LoadedModel) -> None:
    router = RouterSection(port=0, files_bytes=6000)
    cluster = start_cluster(tiny, workers=1, http=True, router=router)
    try:
        client = sdk(cluster)
        client.files.create(file=("a.jsonl", b"x" * 2000), purpose="batch")
        with pytest.raises(openai.APIStatusError, match=r"router\.files_bytes") as refused:
            client.files.create(file=("b.jsonl", b"x" * 3000), purpose="batch")
        assert refused.value.status_code == 413
        # a batch's output is kept past the bound; then no batch starts until files go
        batch = run(client, [line(f"f{i}", chat(SYSTEMS[0], f"Q{i}?")) for i in range(4)])
        assert batch.status == "completed" and batch.output_file_id is not None
        source = upload_anyway(cluster, [line("late", chat(SYSTEMS[0], "Late?"))])
        with pytest.raises(openai.BadRequestError, match=r"delete files before creating a batch"):
            client.batches.create(input_file_id=source, endpoint=CHAT, completion_window="24h")
    finally:
        cluster.close()
    off = start_cluster(tiny, workers=1, http=True, router=replace(router, files_bytes=0))
    try:
        client = sdk(off)
        with pytest.raises(openai.NotFoundError, match="keeps no files"):
            client.batches.list()
    finally:
        off.close()


def test_requests_refused_for_load_wait_for_room(tiny: LoadedModel) -> None:
    """A router that takes 2 requests at once, a batch that sends 8: every request is served
    (each refused one sent again after a pause), none recorded as refused."""
    router = RouterSection(port=0, max_in_flight=2, batch_max_in_flight=8)
    cluster = start_cluster(tiny, workers=1, http=True, router=router)
    try:
        client = sdk(cluster)
        refused = cluster.service.counters.by_status.get("RESOURCE_EXHAUSTED", 0)
        batch = run(client, [line(f"w{i}", chat(SYSTEMS[i % 2], f"W{i}?")) for i in range(16)])
        assert batch.request_counts.completed == 16 and batch.error_file_id is None
        assert cluster.service.counters.by_status.get("RESOURCE_EXHAUSTED", 0) > refused
    finally:
        cluster.close()


def test_a_router_that_drains_sends_no_more_and_the_batch_ends_cancelled(
    tiny: LoadedModel,
) -> None:
    router = RouterSection(port=0, batch_max_in_flight=2)
    cluster = start_cluster(tiny, workers=1, http=True, router=router)
    try:
        client = sdk(cluster)
        lines = [
            line(f"d{i}", chat(SYSTEMS[0], f"D{i}.", max_tokens=40, ignore_eos=True))
            for i in range(30)
        ]
        batch_id = started(client, lines, 2)
        assert cluster.http is not None
        cluster.http.api.draining = True
        ended = finished(client, batch_id)
        assert ended.status == "cancelled" and ended.errors is not None
        assert [e.code for e in ended.errors.data] == ["router_draining"]
        done = ended.request_counts.completed
        assert 2 <= done < 30 and ended.request_counts.failed == 0  # none sent into the drain
        assert len(answers(client, ended.output_file_id)) == done
        assert_no_leak(cluster)
    finally:
        cluster.close()


def test_the_prefix_order_serves_more_from_cache_than_the_files(tiny: LoadedModel) -> None:
    """One worker whose pool holds one document's prompt at a time, one request at a time, two
    documents asked alternately: in the file's order each question evicts the other document;
    sorted by prompt, each document's questions follow one another."""
    documents = [" ".join(f"{w}{i}" for i in range(40)) for w in ("alpha", "omega")]
    lines = [
        line(f"d{i % 2}-{i}", chat(documents[i % 2], f"Question {i}?", max_tokens=2))
        for i in range(8)
    ]
    cached = {}
    for order in ("file", "prefix"):
        router = RouterSection(port=0, batch_order=order, batch_max_in_flight=1)
        engine = replace(ENGINE, num_pages=80, max_model_len=320)  # 320 positions
        cluster = start_cluster(tiny, workers=1, http=True, router=router, engine=engine)
        try:
            client = sdk(cluster)
            batch = run(client, lines)
            assert batch.request_counts.completed == 8
            cached[order] = batch.usage.input_tokens_details.cached_tokens
        finally:
            cluster.close()
    prompt = batch.usage.input_tokens // 8
    assert cached["prefix"] >= 6 * (prompt // 2) > cached["file"], (cached, prompt)


@given(st.lists(st.text("ab ", max_size=6), min_size=3, max_size=12))
def test_the_prefix_order_keeps_requests_sharing_a_prefix_together(texts: list[str]) -> None:
    """Sorted keys are a walk of their prefix tree: the common prefix of two requests is never
    longer than that of any request between them and either."""
    lines = [BatchLine(i, f"c{i}", {"prompt": t}) for i, t in enumerate(texts)]
    keys = [prompt_key(x) for x in prefix_order(lines)]

    def common(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for i in range(len(keys)):
        for j in range(i + 2, len(keys)):
            for k in range(i + 1, j):
                assert common(keys[i], keys[j]) <= min(
                    common(keys[i], keys[k]), common(keys[k], keys[j])
                )


def test_under_the_priority_policy_a_batch_yields_to_interactive_requests(
    tiny: LoadedModel,
) -> None:
    """One running slot, a batch of long requests in it: an interactive request (priority 0)
    preempts the batch's (router.batch_priority 1) and is answered before it ends."""
    engine = replace(ENGINE, scheduling_policy="priority", max_running=1)
    cluster = start_cluster(tiny, workers=1, http=True, engine=engine)
    try:
        client = sdk(cluster)
        (worker,) = cluster.engines.values()
        lines = [
            line(f"b{i}", chat(SYSTEMS[0], f"B{i}.", max_tokens=300, ignore_eos=True))
            for i in range(2)
        ]
        batch = client.batches.create(
            input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while worker.stats().running < 1 or worker.stats().generated_tokens < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        answer = client.chat.completions.create(**chat(SYSTEMS[1], "Now?", max_tokens=2))
        assert answer.choices[0].finish_reason == "length"
        assert client.batches.retrieve(batch.id).request_counts.completed == 0  # still running
        assert worker.stats().preemptions >= 1
        ended = finished(client, batch.id)
        assert ended.request_counts.completed == 2
    finally:
        cluster.close()
