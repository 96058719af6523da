"""Stored responses, stored chat completions and conversations outliving a restart of the
router's HTTP face (`router.state_dir`), through the `openai` SDK on a local cluster of two
tiny-model workers: the HTTP server is stopped and a new one started over the same directory,
as a restarted router would. What was stored reads back as answered, a follow-up continues a
chain or a conversation stored before, what was deleted stays deleted, a response the router
went down under reads as failed, and a file that cannot be read is left out and removed."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from cluster.config import RouterSection
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_http_batches_restart import restarted, started_again, state, stopped
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.test_http_responses_background import running as generating
from tests.cluster.tool_fixtures import LONG_CONTEXT
from worker.loader import LoadedModel

GREEDY: dict[str, Any] = {"model": SERVED_NAME, "max_output_tokens": 6, "temperature": 0}


@pytest.fixture
def cluster(tiny: LoadedModel, tmp_path: Path) -> Iterator[LocalCluster]:
    router = RouterSection(port=0, state_dir=str(tmp_path / "state"))
    running = start_cluster(tiny, http=True, router=router, engine=LONG_CONTEXT)
    yield running
    running.close()


def sdk(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0)


def records(cluster: LocalCluster, store: str) -> dict[str, dict[str, Any]]:
    """The store's files: id -> record."""
    found = {}
    for path in (state(cluster) / store).glob("*.json"):
        record = json.loads(path.read_bytes())
        found[record["key"]] = record
    return found


def test_a_chain_a_completion_and_a_conversation_outlive_a_restart(cluster: LocalCluster) -> None:
    client = sdk(cluster)
    first = client.responses.create(input="Name a colour.", **GREEDY)
    second = client.responses.create(input="And another?", previous_response_id=first.id, **GREEDY)
    completion = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=5,
        temperature=0,
        store=True,
        metadata={"run": "before"},
    )
    talk = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Hello there."}],
        metadata={"topic": "greeting"},
    )
    in_talk = client.responses.create(input="Say hi.", conversation=talk.id, **GREEDY)
    gone = client.responses.create(input="Forget me.", **GREEDY)
    client.responses.delete(gone.id)
    items = [item.id for item in client.conversations.items.list(talk.id)]

    client = restarted(cluster)
    assert client.responses.retrieve(second.id) == second
    assert client.responses.retrieve(in_talk.id).output_text == in_talk.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    assert [i.id for i in client.responses.input_items.list(second.id)] == [
        i.id for i in sdk(cluster).responses.input_items.list(second.id)
    ]
    # the chain goes on as if the router had not stopped: the same answer as the whole
    # conversation sent again, its earlier turns read from the cache
    third = client.responses.create(input="One more?", previous_response_id=second.id, **GREEDY)
    whole = [
        {"role": "user", "content": "Name a colour."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And another?"},
        *[item.model_dump(exclude_none=True) for item in second.output],
        {"role": "user", "content": "One more?"},
    ]
    again = client.responses.create(input=whole, store=False, **GREEDY)  # type: ignore[arg-type]
    assert third.output_text == again.output_text
    assert third.usage is not None and third.usage.input_tokens_details.cached_tokens > 0

    kept = client.chat.completions.retrieve(completion.id)
    assert kept.choices[0].message.content == completion.choices[0].message.content
    assert kept.metadata == {"run": "before"}
    later = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "Count to four."}],
        max_tokens=5,
        temperature=0,
        store=True,
    )
    listed = [c.id for c in client.chat.completions.list()]
    assert listed.index(completion.id) < listed.index(later.id)  # listed in the order made

    assert client.conversations.retrieve(talk.id).metadata == {"topic": "greeting"}
    assert [item.id for item in client.conversations.items.list(talk.id)] == items
    client.responses.create(input="Say bye.", conversation=talk.id, **GREEDY)
    assert len(list(client.conversations.items.list(talk.id))) > len(items)

    client.conversations.delete(talk.id)
    client.chat.completions.delete(completion.id)
    client = restarted(cluster)  # deleted after the first restart: gone after the second
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(talk.id)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(completion.id)
    assert client.chat.completions.retrieve(later.id).id == later.id
    assert client.responses.retrieve(third.id).output_text == third.output_text
    assert_no_leak(cluster)


def test_a_response_the_router_went_down_under_reads_as_failed(cluster: LocalCluster) -> None:
    """The files as a crash leaves them (copied while the response ran, put back after the
    stop): the response read back as failed, naming why, not in progress for ever."""
    client = sdk(cluster)
    running = generating(client)
    saved = state(cluster) / "responses"
    deadline = time.monotonic() + 30
    while records(cluster, "responses").get(running.id, {}).get("value", {}).get("status") not in (
        "queued",
        "in_progress",
    ):
        assert time.monotonic() < deadline, "the running response was never written"
        time.sleep(0.05)
    crashed = state(cluster).parent / "crashed"
    shutil.copytree(saved, crashed)
    stopped(cluster)  # a clean stop ends it cancelled
    assert records(cluster, "responses")[running.id]["value"]["status"] == "cancelled"
    shutil.rmtree(saved)
    shutil.copytree(crashed, saved)
    client = started_again(cluster)
    failed = client.responses.retrieve(running.id)
    assert failed.status == "failed"
    assert failed.error is not None and "router stopped" in failed.error.message
    assert_no_leak(cluster)


def test_a_file_that_cannot_be_read_is_left_out_and_the_rest_read_back(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    client = sdk(cluster)
    made = [client.responses.create(input=f"Say {i}.", **GREEDY) for i in range(3)]
    stopped(cluster)
    by_key = {key: record for key, record in records(cluster, "responses").items()}
    paths = {json.loads(p.read_bytes())["key"]: p for p in (state(cluster) / "responses").glob("*")}
    paths[made[0].id].write_bytes(b'{"tenant": "", "key": "')  # cut short by a crash
    mangled = by_key[made[1].id] | {"value": {"response": 1}}
    paths[made[1].id].write_text(json.dumps(mangled))  # not a response
    client = started_again(cluster)
    for bad in made[:2]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(bad.id)
        assert not paths[bad.id].exists()
    assert client.responses.retrieve(made[2].id).output_text == made[2].output_text
    assert "left out" in caplog.text
