"""Files and batches outliving a restart of the router's HTTP face (`router.state_dir`), on a
local cluster of two tiny-model workers, through the `openai` SDK: the HTTP server is stopped
under a running batch and a new one started over the same directory, as a restarted router
would; the batch goes on with the lines that had no answer, keeping the answers it had (the
same request ids: nothing answered runs twice), and ends with every line once, in order. Files
uploaded and deleted stay so; an ended batch reads as it ended; a journal line cut short by a
crash is left out; a card or content that cannot be read is left out and removed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from cluster.config import RouterSection
from cluster.http import batches
from cluster.http.file_store import ENTRY_BYTES, FileStore
from cluster.http.server import start_http_server
from tests.cluster.local_cluster import ENGINE, LocalCluster, start_cluster
from tests.cluster.test_http_batches import (
    SYSTEMS,
    answers,
    chat,
    finished,
    line,
    sdk,
    started,
    upload,
)
from tests.cluster.test_http_openai import assert_no_leak
from worker.loader import LoadedModel


@pytest.fixture
def cluster(tiny: LoadedModel, tmp_path: Path) -> Iterator[LocalCluster]:
    router = RouterSection(port=0, state_dir=str(tmp_path / "state"), batch_max_in_flight=2)
    running = start_cluster(tiny, http=True, router=router, engine=ENGINE)
    yield running
    running.close()


def stopped(cluster: LocalCluster) -> None:
    """Stop the HTTP face: its batches left running on disk, for the next one."""
    assert cluster.http is not None
    cluster.loop.run(cluster.http.stop(0.5))


def started_again(cluster: LocalCluster) -> openai.OpenAI:
    """A new HTTP face over the same state directory, as a restarted router starts; the SDK
    on it."""
    cluster.http = cluster.loop.run(start_http_server(cluster.service, cluster.config))
    return sdk(cluster)


def restarted(cluster: LocalCluster) -> openai.OpenAI:
    stopped(cluster)
    return started_again(cluster)


def state(cluster: LocalCluster) -> Path:
    assert cluster.config.router.state_dir is not None
    return Path(cluster.config.router.state_dir)


def test_a_running_batch_goes_on_after_a_restart(cluster: LocalCluster) -> None:
    client = sdk(cluster)
    lines = [
        line(f"r{i}", chat(SYSTEMS[i % 2], f"Say {i}.", max_tokens=40, ignore_eos=True))
        for i in range(12)
    ]
    batch_id = started(client, lines, 3)  # two at a time (batch_max_in_flight)
    stopped(cluster)
    saved = json.loads((state(cluster) / "batches" / f"{batch_id}.json").read_bytes())
    assert saved["batch"]["status"] == "in_progress"  # left to the next router, not cancelled
    journal = state(cluster) / "batches" / f"{batch_id}.answers.jsonl"
    before = {}
    for raw in journal.read_bytes().splitlines():
        entry = json.loads(raw)
        before[entry["answer"]["custom_id"]] = entry["answer"]["id"]
    assert 3 <= len(before) < 12
    client = started_again(cluster)
    ended = finished(client, batch_id)
    assert ended.status == "completed" and ended.error_file_id is None
    assert ended.request_counts.completed == 12 and ended.request_counts.failed == 0
    assert ended.usage is not None and ended.usage.output_tokens == 12 * 40
    got = answers(client, ended.output_file_id)
    assert [a["custom_id"] for a in got] == [f"r{i}" for i in range(12)]  # each once, in order
    assert {a["custom_id"]: a["id"] for a in got if a["custom_id"] in before} == before
    assert not journal.exists()  # the batch ended: its answers are in its output file
    client = restarted(cluster)  # and it reads as it ended after one more restart
    again = client.batches.retrieve(batch_id)
    assert again.status == "completed" and again.output_file_id == ended.output_file_id
    assert answers(client, again.output_file_id) == got
    assert_no_leak(cluster)


def test_files_stay_as_they_were_left(cluster: LocalCluster) -> None:
    client = sdk(cluster)
    kept = upload(client, [line("a", chat(SYSTEMS[0], "A?"))])
    gone = upload(client, [line("b", chat(SYSTEMS[1], "B?"))])
    content = client.files.content(kept).content
    client.files.delete(gone)
    client = restarted(cluster)
    assert [f.id for f in client.files.list(purpose="batch")] == [kept]
    assert client.files.content(kept).content == content
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(gone)
    assert sorted(p.name for p in (state(cluster) / "files").iterdir()) == [
        f"{kept}.bin",
        f"{kept}.json",
    ]
    assert cluster.http is not None
    held = cluster.http.api.files.held
    assert held == len(content) + ENTRY_BYTES  # the bound counts what came back


def test_a_journal_line_cut_short_is_left_out(cluster: LocalCluster) -> None:
    client = sdk(cluster)
    lines = [  # long enough that the batch still runs when the router stops, however slow
        line(f"t{i}", chat(SYSTEMS[0], f"Count {i}.", max_tokens=200, ignore_eos=True))
        for i in range(8)
    ]
    batch_id = started(client, lines, 2)
    stopped(cluster)
    saved = json.loads((state(cluster) / "batches" / f"{batch_id}.json").read_bytes())
    assert saved["batch"]["status"] == "in_progress"
    journal = state(cluster) / "batches" / f"{batch_id}.answers.jsonl"
    with journal.open("ab") as f:
        f.write(b'{"line": 7, "answer": {"id": "cut')  # as a crash mid-write leaves it
    client = started_again(cluster)
    # written again whole as the batch went on (resume is done when the server starts): the
    # cut line gone, so the next answers are not glued to it
    assert b'"cut' not in journal.read_bytes()
    assert all(json.loads(r) for r in journal.read_bytes().splitlines())
    ended = finished(client, batch_id)
    assert ended.status == "completed" and ended.request_counts.completed == 8
    assert [a["custom_id"] for a in answers(client, ended.output_file_id)] == [
        f"t{i}" for i in range(8)
    ]


def test_a_card_or_content_that_cannot_be_read_is_left_out(tmp_path: Path) -> None:
    store = FileStore(1 << 20, tmp_path)
    good = store.keep("acme", "a.jsonl", "batch", b"{}\n")
    torn = store.keep("acme", "b.jsonl", "batch", b"[]\n")
    for card in (good, torn):
        FileStore._write(tmp_path, "acme", store.get("acme", card.id))
    (tmp_path / f"{torn.id}.bin").write_bytes(b"[")  # shorter than its card says
    (tmp_path / "file-orphan.bin").write_bytes(b"x")  # content whose card was never written
    (tmp_path / "file-bad.json").write_bytes(b"{not json")
    back = FileStore(1 << 20, tmp_path)
    assert [c.id for c in back.cards("acme")] == [good.id]
    assert back.get("acme", good.id).content == b"{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{good.id}.bin", f"{good.id}.json"]


def test_a_drained_router_leaves_its_batch_to_the_next(cluster: LocalCluster) -> None:
    """`radixmesh serve` drains before it stops: the batch stops sending, the requests in
    flight end and are journalled, and the next router goes on with it."""
    client = sdk(cluster)
    lines = [
        line(f"d{i}", chat(SYSTEMS[1], f"Drain {i}.", max_tokens=40, ignore_eos=True))
        for i in range(10)
    ]
    batch_id = started(client, lines, 2)
    assert cluster.http is not None
    cluster.http.api.draining = True  # as the router actor drains
    cluster.wait_idle()
    stopped(cluster)
    saved = json.loads((state(cluster) / "batches" / f"{batch_id}.json").read_bytes())
    assert saved["batch"]["status"] == "in_progress"
    client = started_again(cluster)
    ended = finished(client, batch_id)
    assert ended.status == "completed" and ended.request_counts.completed == 10
    assert [a["custom_id"] for a in answers(client, ended.output_file_id)] == [
        f"d{i}" for i in range(10)
    ]


def test_a_batch_ended_again_replaces_its_files(cluster: LocalCluster) -> None:
    """A router that stopped after writing a batch's files but before its object said it
    ended: the next one ends it again, with the same files, not a second set."""
    client = sdk(cluster)
    lines = [line(f"f{i}", chat(SYSTEMS[0], f"Once {i}.")) for i in range(4)]
    batch_id = started(client, lines, 4)
    ended = finished(client, batch_id)
    got = answers(client, ended.output_file_id)
    stopped(cluster)
    folder = state(cluster) / "batches"
    saved = json.loads((folder / f"{batch_id}.json").read_bytes())
    saved["batch"]["status"] = "in_progress"  # as it was until it ended
    (folder / f"{batch_id}.json").write_text(json.dumps(saved))
    rows = [{"line": k, "answer": a} for k, a in enumerate(got, start=1)]
    (folder / f"{batch_id}.answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = sorted(p.name for p in (state(cluster) / "files").iterdir())
    client = started_again(cluster)
    again = finished(client, batch_id)
    assert again.status == "completed" and again.output_file_id == ended.output_file_id
    assert answers(client, again.output_file_id) == got
    assert sorted(p.name for p in (state(cluster) / "files").iterdir()) == before
    assert len(client.files.list(purpose="batch_output").data) == 1


def test_an_input_file_in_use_is_not_deleted(cluster: LocalCluster) -> None:
    client = sdk(cluster)
    lines = [
        line(f"u{i}", chat(SYSTEMS[0], f"Use {i}.", max_tokens=60, ignore_eos=True))
        for i in range(6)
    ]
    batch_id = started(client, lines, 1)
    source = client.batches.retrieve(batch_id).input_file_id
    with pytest.raises(openai.ConflictError, match="still runs the requests"):
        client.files.delete(source)
    finished(client, batch_id)
    assert client.files.delete(source).deleted  # once it ended


def test_a_batch_forgotten_here_is_forgotten_on_disk(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("cluster.http.batches.MAX_ENDED", 1)
    client = sdk(cluster)
    bad = upload(client, ['{"custom_id": "x"}'])  # not a request: the batch fails at once
    first = client.batches.create(
        input_file_id=bad, endpoint="/v1/chat/completions", completion_window="24h"
    )
    second = client.batches.create(
        input_file_id=bad, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert (first.status, second.status) == ("failed", "failed")
    names = sorted(p.name for p in (state(cluster) / "batches").iterdir())
    assert names == [f"{second.id}.json"]


def test_an_ended_batch_whose_object_cannot_be_written_keeps_its_journal(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its answers stay on disk: the next router ends it again from them, running nothing."""
    client = sdk(cluster)
    lines = [line(f"j{i}", chat(SYSTEMS[0], f"Keep {i}.")) for i in range(3)]
    real = batches.write_json

    def full_disk(path: Path, value: object) -> None:
        if isinstance(value, dict) and value["batch"]["status"] in batches.ENDED:
            raise OSError(28, "No space left on device")
        real(path, value)

    monkeypatch.setattr(batches, "write_json", full_disk)
    batch_id = started(client, lines, 3)
    ended = finished(client, batch_id)
    assert ended.status == "completed"
    journal = state(cluster) / "batches" / f"{batch_id}.answers.jsonl"
    assert len(journal.read_bytes().splitlines()) == 3
    monkeypatch.setattr(batches, "write_json", real)
    client = restarted(cluster)
    again = finished(client, batch_id)
    assert [a["id"] for a in answers(client, again.output_file_id)] == [
        a["id"] for a in answers(client, ended.output_file_id)
    ]
    assert not journal.exists()
