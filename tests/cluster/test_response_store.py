"""The Responses API's store (cluster/http/response_store.py) against a plain model of it, over
random puts, reads and deletes by two tenants: the same responses kept, in the same order of
use, its byte count exact and within the bound; and that count against what tracemalloc sees."""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.http.conversations import ENTRY_BYTES, Conversation, ConversationStore
from cluster.http.errors import HttpError
from cluster.http.openai_responses import Counts
from cluster.http.response_store import ResponseStore, StoredResponse
from cluster.http.responses_chain import encoded_inputs, keep
from cluster.http.responses_output import done, shell
from cluster.http.responses_schema import ResponsesRequest

BOUND = 2_000

operation = st.tuples(
    st.sampled_from(["put", "get", "delete"]),
    st.sampled_from(["acme", "globex"]),
    st.sampled_from([f"resp_{i}" for i in range(6)]),
    st.integers(0, BOUND + 200),  # what a put adds to the conversation's bytes
)


def response(response_id: str, grown: int) -> StoredResponse:
    return StoredResponse(
        response=json.dumps({"id": response_id}).encode(),
        inputs=(),
        conversation=(),
        conversation_bytes=grown,
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(operation, max_size=60))
def test_the_store_drops_the_largest_tenants_least_recent_within_its_bound(
    operations: list[tuple[str, str, str, int]],
) -> None:
    store = ResponseStore(BOUND)
    # tenant -> id -> size, least recent first
    model: dict[str, OrderedDict[str, int]] = {"acme": OrderedDict(), "globex": OrderedDict()}
    holders: list[str] = []  # tenants holding any, in the order they began to: ties go first

    def held(tenant: str) -> int:
        return sum(model[tenant].values())

    def taken(tenant: str, response_id: str) -> bool:
        found = model[tenant].pop(response_id, None) is not None
        if found and not model[tenant]:
            holders.remove(tenant)
        return found

    for kind, tenant, response_id, grown in operations:
        if kind == "put":
            kept = response(response_id, grown)
            fits = kept.size <= BOUND
            assert store.put(tenant, response_id, kept) is fits
            taken(tenant, response_id)  # replaced, or gone with a put too large to keep
            if fits:
                while held("acme") + held("globex") + kept.size > BOUND:
                    owner = max(holders, key=lambda t: held(t) + kept.size * (t == tenant))
                    taken(owner, next(iter(model[owner])))
                if not model[tenant]:
                    holders.append(tenant)
                model[tenant][response_id] = kept.size
        elif kind == "get":
            found = store.get(tenant, response_id)
            assert (found is not None) is (response_id in model[tenant])
            if found is not None:
                assert json.loads(found.response)["id"] == response_id
                model[tenant].move_to_end(response_id)
        else:
            assert store.delete(tenant, response_id) is taken(tenant, response_id)
        assert store.bytes == held("acme") + held("globex") <= BOUND
        for name, ids in model.items():
            assert [key for key, _ in store.of(name)] == list(ids)
            assert store.held(name) == held(name)
        assert len(store) == sum(len(ids) for ids in model.values())


def test_a_tenant_storing_much_pushes_out_its_own_not_anothers() -> None:
    """globex keeps putting; acme's one response, older than all of globex's, stays."""
    store = ResponseStore(BOUND)
    assert store.put("acme", "resp_a", response("resp_a", 100))
    for i in range(20):
        assert store.put("globex", f"resp_{i}", response(f"resp_{i}", 300))
    assert store.get("acme", "resp_a") is not None
    assert store.get("globex", "resp_19") is not None and store.get("globex", "resp_0") is None
    assert store.bytes <= BOUND


def test_a_tenant_reads_only_its_own() -> None:
    store = ResponseStore(BOUND)
    assert store.put("acme", "resp_1", response("resp_1", 10))
    assert store.get("globex", "resp_1") is None
    assert not store.delete("globex", "resp_1")
    assert store.get("acme", "resp_1") is not None


@pytest.mark.parametrize("words", [1, 40])
def test_what_the_store_counts_is_at_least_what_it_holds(words: int) -> None:
    """The bound is on memory: what tracemalloc sees the kept responses take is no more than
    the bytes the store counts for them (single turns, where nothing is shared)."""
    store = ResponseStore(1 << 30)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(300):
            body = ResponsesRequest(model="m", input=f"Question {i}: " + "what is a page? " * words)
            started = shell(body, f"resp_{i:032d}", "m", True)
            answered = done(started, "An answer. " * words, [], "stop", Counts(prompt_tokens=9))
            keep(store, "", encoded_inputs(body), answered, None)
        gc.collect()  # garbage in cycles (pydantic's) is not held, whenever gc next runs
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) == 300 and held <= store.bytes


def test_conversations_held_by_a_response_make_room_as_the_other_stores() -> None:
    """The conversation store keeps its holds beside what KeptStore counts: holding one while
    two tenants fill the store leaves the accounting whole and the hold in place."""
    store = ConversationStore(6 * ENTRY_BYTES)
    store.keep("acme", Conversation("conv_a", 0, {}))
    release = store.hold("acme", "conv_a")
    for i in range(12):
        assert store.keep("globex", Conversation(f"conv_{i}", 0, {}))
    assert store.get("acme", "conv_a") is not None  # globex pushed out its own
    assert store.bytes == sum(c.size for t in ("acme", "globex") for _, c in store.of(t))
    with pytest.raises(HttpError, match="another response is running"):
        store.hold("acme", "conv_a")
    release()
    store.hold("acme", "conv_a")()


def chained(response_id: str, grown: int) -> StoredResponse:
    """A response whose conversation is one item of about `grown` bytes, as a store keeps one
    (its count the sum of its items')."""
    item = json.dumps({"type": "message", "content": "x" * grown}).encode()
    kept = response(response_id, len(item))
    return StoredResponse(kept.response, (item,), (item,), len(item))


def test_on_disk_read_back_in_the_order_kept_within_the_bound_as_it_is_now(
    tmp_path: Path,
) -> None:
    store = ResponseStore(10 * BOUND, tmp_path)
    for i in range(4):
        assert store.put("acme", f"resp_{i}", chained(f"resp_{i}", 100))
    store.get("acme", "resp_0")  # a read is not written: read back, it is as old as it was put
    assert store.put("acme", "resp_1", chained("resp_1", 150))  # kept again: the most recent
    store.delete("acme", "resp_2")
    store.close()
    assert len(list(tmp_path.glob("*.json"))) == 3
    sizes = {key: kept.size for key, kept in store.of("acme")}
    smaller = ResponseStore(sizes["resp_3"] + sizes["resp_1"], tmp_path)
    assert smaller.restore() == 2
    assert [key for key, _ in smaller.of("acme")] == ["resp_3", "resp_1"]
    assert smaller.get("acme", "resp_1") == store.get("acme", "resp_1")
    smaller.close()
    assert len(list(tmp_path.glob("*.json"))) == 2  # the one dropped is removed


def test_a_store_without_a_directory_writes_nothing(tmp_path: Path) -> None:
    store = ResponseStore(BOUND)
    assert store.files is None and store.restore() == 0
    assert ResponseStore(0, tmp_path).files is None  # keeping nothing: nothing on disk


def test_what_no_file_holds_is_left_out_and_the_store_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record whose numbers overflow or whose JSON nests past the parser's depth is left out
    and removed, as a file cut short is: the router starts with the rest."""
    store = ConversationStore(10 * BOUND, tmp_path)
    for i in range(3):
        assert store.keep("acme", Conversation(f"conv_{i}", 0, {}))
    store.close()
    path = store.files.path("acme", "conv_0")  # type: ignore[union-attr]
    record = json.loads(path.read_bytes())
    path.write_text(json.dumps(record).replace('"created_at": 0', '"created_at": 1e999'))
    store.files.path("acme", "conv_1").write_text("[" * 100_000)  # type: ignore[union-attr]
    again = ConversationStore(10 * BOUND, tmp_path)
    assert again.restore() == 1 and again.get("acme", "conv_2") is not None
    again.close()
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert caplog.text.count("left out") == 2


def test_a_deletion_after_the_stop_is_not_undone_by_the_next_router(tmp_path: Path) -> None:
    """A request that outlived the router's stop deletes a response: its file goes at once."""
    store = ResponseStore(10 * BOUND, tmp_path)
    assert store.put("acme", "resp_1", chained("resp_1", 10))
    store.close()
    assert store.delete("acme", "resp_1")
    assert ResponseStore(10 * BOUND, tmp_path).restore() == 0


def test_a_chain_read_back_shares_its_earlier_items_again(tmp_path: Path) -> None:
    """Each file holds its whole chain; read back, the turns share the items they did."""
    store = ResponseStore(10 * BOUND, tmp_path)
    first = chained("resp_1", 10)
    second = StoredResponse(
        response("resp_2", 0).response,
        (b'"next"',),
        (*first.conversation, b'"next"'),
        first.conversation_bytes + 6,
    )
    store.put("acme", "resp_1", first)
    store.put("acme", "resp_2", second)
    store.close()
    again = ResponseStore(10 * BOUND, tmp_path)
    assert again.restore() == 2
    one, two = again.get("acme", "resp_1"), again.get("acme", "resp_2")
    assert one is not None and two is not None and two.conversation[0] is one.conversation[0]
    assert two == second


def test_a_write_that_fails_leaves_the_writer_writing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Failing(ResponseStore):
        def saved(self, value: StoredResponse) -> dict[str, Any]:
            if b"resp_bad" in value.response:
                raise TypeError("cannot encode it")
            return super().saved(value)

    store = Failing(10 * BOUND, tmp_path)
    assert store.put("acme", "resp_bad", chained("resp_bad", 10))
    assert store.put("acme", "resp_good", chained("resp_good", 10))
    store.close()
    again = ResponseStore(10 * BOUND, tmp_path)
    assert again.restore() == 1 and again.get("acme", "resp_good") is not None
    assert "not written" in caplog.text
