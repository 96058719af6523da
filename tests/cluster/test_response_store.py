"""The Responses API's store (cluster/http/response_store.py) against a plain model of it, over
random puts, reads and deletes by two tenants: the same responses kept, in the same order of
use, its byte count exact and within the bound; and that count against what tracemalloc sees."""

from __future__ import annotations

import gc
import json
import tracemalloc
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
def test_the_store_is_an_lru_within_its_bound(operations: list[tuple[str, str, str, int]]) -> None:
    store = ResponseStore(BOUND)
    model: OrderedDict[tuple[str, str], int] = OrderedDict()  # key -> size, least recent first
    for kind, tenant, response_id, grown in operations:
        key = (tenant, response_id)
        if kind == "put":
            kept = response(response_id, grown)
            fits = kept.size <= BOUND
            assert store.put(tenant, response_id, kept) is fits
            model.pop(key, None)  # replaced, or gone with a put too large to keep
            if fits:
                while sum(model.values()) + kept.size > BOUND:
                    model.popitem(last=False)
                model[key] = kept.size
        elif kind == "get":
            found = store.get(tenant, response_id)
            assert (found is not None) is (key in model)
            if found is not None:
                assert json.loads(found.response)["id"] == response_id
                model.move_to_end(key)
        else:
            assert store.delete(tenant, response_id) is (model.pop(key, None) is not None)
        assert store.bytes == sum(model.values()) <= BOUND
        assert list(store._kept) == list(model)
        assert len(store) == len(model)


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
