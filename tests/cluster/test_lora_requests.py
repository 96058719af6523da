"""A LoRA request made routable (cluster/requests.py): an adapter no worker holds is refused by
name before any tokenising; a known one runs in the namespace of its identity (what the router
hashes and indexes under) while the worker is sent its NAME (each worker maps the name to the
weights it holds)."""

from __future__ import annotations

import pytest

from cache import CacheNamespace
from cluster.client import text_request
from cluster.requests import prepare, request_namespace
from cluster.stream_progress import StreamProgress
from worker.errors import InvalidRequest
from worker.validation import RequestLimits

LIMITS = RequestLimits(vocab_size=100, max_model_len=256)
HELD = {"caps": "caps@9f3a", "sql": "sql@01bc"}


class Refusing:
    """A tokenizer that fails the test if it is asked anything."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("an unknown adapter must be refused before any tokenising")

    def apply_chat_template(self, messages: list[dict[str, object]]) -> str:
        raise AssertionError("an unknown adapter must be refused before any tokenising")


def test_a_known_adapter_runs_in_its_identity_and_goes_to_workers_by_name() -> None:
    message = text_request(token_ids=[1, 2, 3], adapter="caps", tenant="acme")
    prepared = prepare(message, None, LIMITS, adapters=HELD)
    assert prepared.namespace == CacheNamespace(adapter="caps@9f3a", tenant="acme")
    assert prepared.adapter == "caps"
    (call,) = StreamProgress(prepared).worker_requests(0, (7, 8))
    assert (call.namespace.adapter, call.namespace.tenant) == ("caps", "acme")
    base = prepare(text_request(token_ids=[1, 2, 3]), None, LIMITS, adapters=HELD)
    assert base.namespace == CacheNamespace() and base.adapter is None
    (plain,) = StreamProgress(base).worker_requests(0)
    assert plain.namespace.adapter == ""


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        (HELD, "namespace.adapter: unknown adapter 'shouty' (loaded: caps, sql)"),
        ({}, "namespace.adapter: unknown adapter 'shouty' (loaded: none)"),
        (None, "namespace.adapter: unknown adapter 'shouty' (loaded: none)"),
    ],
)
def test_an_adapter_no_worker_holds_is_refused_naming_the_loaded_ones(
    held: dict[str, str] | None, expected: str
) -> None:
    message = text_request("a text the tokenizer must never see", adapter="shouty")
    with pytest.raises(InvalidRequest) as err:
        prepare(message, Refusing(), LIMITS, adapters=held)
    assert str(err.value) == expected


def test_an_overlong_adapter_name_is_refused_by_its_length_never_quoted() -> None:
    message = text_request("text", adapter="x" * 20_000)
    with pytest.raises(InvalidRequest) as err:
        prepare(message, Refusing(), LIMITS, adapters=HELD)
    assert "20000 characters; at most 128" in str(err.value)
    assert len(str(err.value)) < 200


def test_a_tenant_bound_token_keeps_its_tenant_beside_the_adapter() -> None:
    message = text_request(token_ids=[1], adapter="sql", tenant="")
    assert request_namespace(message, "globex", HELD) == CacheNamespace(
        adapter="sql@01bc", tenant="globex"
    )
