"""A fuzzer against the real router and workers: arbitrary well-formed and malformed requests.

Every answer is a finished stream or one of the documented statuses; afterwards the server is
healthy and no page is leaked.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.client import Client
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import start_cluster
from worker.loader import load_model
from worker.tiny_model import build_tiny_checkpoint

DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
ints = st.integers(-(2**31), 2**31 - 1)
valid_sampling = st.builds(
    serving_pb2.SamplingParams,
    max_tokens=st.integers(1, 8),
    temperature=st.floats(0, 1.5, width=32),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.25, 1, width=32),
    seed=st.integers(0, 2**40),
    n=st.just(1),
    stop=st.lists(st.text(min_size=1, max_size=3), max_size=2),
    ignore_eos=st.booleans(),
)
wild_sampling = st.builds(
    serving_pb2.SamplingParams,
    max_tokens=st.one_of(st.integers(-3, 12), ints),
    temperature=st.one_of(st.floats(0, 2, width=32), floats),
    top_k=st.one_of(st.integers(0, 50), ints),
    top_p=st.one_of(st.floats(0.25, 1, width=32), floats),
    seed=st.integers(-(2**63), 2**63 - 1),
    n=st.integers(-1, 4),
    stop=st.lists(st.text(max_size=4), max_size=3),
    stop_token_ids=st.lists(st.integers(-(2**40), 2**40), max_size=3),
    ignore_eos=st.booleans(),
)


@st.composite
def requests(draw: st.DrawFn) -> serving_pb2.GenerateRequest:
    """Half well-formed (valid parts, varied), half wild (anything the schema allows)."""
    wild = draw(st.booleans())
    ids = st.integers(-(2**40), 2**40) | st.integers(0, 600) if wild else st.integers(0, 511)
    request = serving_pb2.GenerateRequest(
        request_id=draw(
            st.text(max_size=10) if wild else st.from_regex(r"[a-z0-9]{0,8}", fullmatch=True)
        ),
        sampling=draw(wild_sampling if wild else valid_sampling),
        namespace=serving_pb2.Namespace(
            adapter=draw(st.sampled_from(["", "lora"]) if wild else st.just("")),
            tenant=draw(st.text(max_size=6)),
        ),
    )
    kinds = ["text", "ids", "chat", "none"] if wild else ["text", "ids", "chat"]
    which = draw(st.sampled_from(kinds))
    if which == "text":
        request.text = draw(st.text(min_size=0 if wild else 1, max_size=120))
    elif which == "ids":
        request.token_ids.ids.extend(draw(st.lists(ids, min_size=0 if wild else 1, max_size=60)))
    elif which == "chat":
        roles = st.just("user") if not wild else st.sampled_from(["user", "system", "", "x"])
        chat = draw(
            st.lists(st.tuples(roles, st.text(max_size=40)), min_size=0 if wild else 1, max_size=3)
        )
        request.chat.messages.extend(serving_pb2.ChatMessage(role=r, content=c) for r, c in chat)
    if wild and draw(st.booleans()):
        request.images.append(draw(st.binary(max_size=16)))
    return request


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tiny = load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    running = start_cluster(tiny)
    yield running
    running.close()


def test_every_answer_is_documented_and_nothing_leaks(cluster) -> None:  # type: ignore[no-untyped-def]
    client = Client(cluster.target)
    outcomes: dict[str, int] = {}

    @settings(max_examples=150, deadline=None)
    @given(request=requests())
    def send(request: serving_pb2.GenerateRequest) -> None:
        try:
            stream = list(client.generate(request, timeout=30))
            finished = [m for m in stream if m.finished]
            n = request.sampling.n if request.sampling.HasField("n") else 1
            assert len(finished) == n, stream
            assert all(m.finish_reason in ("stop", "length") for m in finished)
            outcome = "OK"
        except grpc.RpcError as err:
            assert err.code() in DOCUMENTED, (err.code(), err.details(), request)
            assert err.details(), "a refusal must say why"
            outcome = err.code().name
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    send()
    assert outcomes.get("OK", 0) > 5 and outcomes.get("INVALID_ARGUMENT", 0) > 5, outcomes
    cluster.wait_idle()
    stats = cluster.stats()
    assert all(w.healthy and w.private_pages == 0 for w in stats.workers)
    with grpc.insecure_channel(cluster.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
