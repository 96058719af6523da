"""Requests refused at the door, over the real port: the right status, a plain message, no leak.

Bytes that are not the method's message (not protobuf, truncated, a string field with invalid
UTF-8) are sent raw, on the router's public port and on a worker's own port; every answer is
INVALID_ARGUMENT saying what is "not a valid" message, with no Python class name in it. A caller
without a bearer token gets UNAUTHENTICATED whatever it sends. Then the operator's limits: the
number and length of stop strings, an empty chat, and the prompt's character cap, checked
before tokenising. After each refusal a normal request is served and no worker holds a request
or a private page.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.client import Client, text_request
from cluster.config import EngineSection, SecuritySection
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import ENGINE, LocalCluster, start_cluster
from worker.loader import LoadedModel
from worker.validation import DEFAULT_MAX_PROMPT_CHARS
from worker.wire_errors import Undecodable, plain_reason, tolerant

TOKEN = "wire-test-token"
CORRUPT = "the bytes are not a well-formed protobuf encoding"
BAD_UTF8 = "a string field holds invalid UTF-8"


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (string, bytes, message), built by hand."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


NOT_UTF8 = b"\xff\xfe"
# GenerateRequest: request_id 1, text 2, chat 4 (ChatMessages: messages 1; ChatMessage: role 1,
# content 2), sampling 6 (SamplingParams: stop 7).
UNDECODABLE_GENERATE = {
    "not protobuf": (b"\xff\xff\xff", CORRUPT),
    "truncated": (field(2, b"hello there")[:-4], CORRUPT),
    "text": (field(2, NOT_UTF8), BAD_UTF8),
    "request_id": (field(1, NOT_UTF8) + field(2, b"hello there"), BAD_UTF8),
    "chat content": (field(4, field(1, field(1, b"user") + field(2, NOT_UTF8))), BAD_UTF8),
    "stop string": (field(2, b"hello") + field(6, field(7, b"ok" + NOT_UTF8)), BAD_UTF8),
}


def raw(x: bytes) -> bytes:
    return x


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny)
    yield running
    running.close()


def assert_serving_and_no_leak(cluster: LocalCluster, token: str | None = None) -> None:
    client = Client(cluster.target, token=token)
    try:
        assert list(client.generate(text_request("still serving?", max_tokens=3), 30))[-1].finished
    finally:
        client.close()
    cluster.wait_idle()
    stats = cluster.stats()
    assert all(w.healthy and w.private_pages == 0 for w in stats.workers), stats.workers
    assert len(stats.workers) == len(cluster.engines), "a worker was detached"
    assert stats.requests_in_flight == 0


def call_raw(
    target: str, method: str, body: bytes, streaming: bool, token: str | None = None
) -> list[bytes] | bytes:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(target) as channel:
        if streaming:
            stream = channel.unary_stream(method, request_serializer=raw, response_deserializer=raw)
            return list(stream(body, timeout=30, metadata=metadata))
        unary = channel.unary_unary(method, request_serializer=raw, response_deserializer=raw)
        answer: bytes = unary(body, timeout=30, metadata=metadata)
        return answer


def refused_raw(
    target: str, method: str, body: bytes, streaming: bool, token: str | None = None
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call_raw(target, method, body, streaming, token)
    return err.value


def refused(
    cluster: LocalCluster, request: serving_pb2.GenerateRequest, token: str | None = None
) -> grpc.RpcError:
    client = Client(cluster.target, token=token)
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(request, timeout=60))
    finally:
        client.close()
    return err.value


def served(cluster: LocalCluster, request: serving_pb2.GenerateRequest) -> None:
    client = Client(cluster.target)
    try:
        assert list(client.generate(request, timeout=60))[-1].finished
    finally:
        client.close()


def assert_plain_invalid(err: grpc.RpcError, message: str, reason: str) -> None:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    assert err.details() == f"the request is not a valid {message}: {reason}"


# -- bytes that do not decode -----------------------------------------------------------------


@pytest.mark.parametrize("case", list(UNDECODABLE_GENERATE))
def test_an_undecodable_generate_is_invalid_argument_on_the_public_port(
    cluster: LocalCluster, case: str
) -> None:
    body, reason = UNDECODABLE_GENERATE[case]
    err = refused_raw(cluster.target, "/radixmesh.v1.Serving/Generate", body, streaming=True)
    assert_plain_invalid(err, "radixmesh.v1.GenerateRequest", reason)
    assert "class" not in err.details() and "Error" not in err.details()
    assert_serving_and_no_leak(cluster)


@pytest.mark.parametrize(
    ("method", "body", "message", "reason"),
    [
        ("/radixmesh.v1.Serving/Abort", field(1, NOT_UTF8), "AbortRequest", BAD_UTF8),
        ("/radixmesh.v1.Serving/Abort", b"\xff\xff\xff", "AbortRequest", CORRUPT),
        ("/radixmesh.v1.Serving/GetStats", b"\xff\xff\xff", "GetStatsRequest", CORRUPT),
        ("/radixmesh.v1.Admin/SetPolicy", field(1, NOT_UTF8), "SetPolicyRequest", BAD_UTF8),
    ],
    ids=["abort-utf8", "abort-garbage", "stats-garbage", "setpolicy-utf8"],
)
def test_undecodable_unary_calls_are_invalid_argument_on_the_public_port(
    cluster: LocalCluster, method: str, body: bytes, message: str, reason: str
) -> None:
    err = refused_raw(cluster.target, method, body, streaming=False)
    assert_plain_invalid(err, f"radixmesh.v1.{message}", reason)
    assert cluster.stats().policy == "cache_aware"
    assert_serving_and_no_leak(cluster)


def test_a_workers_own_port_refuses_undecodable_requests_the_same_way(
    cluster: LocalCluster,
) -> None:
    name, server = next(iter(cluster.workers.items()))
    target = f"127.0.0.1:{server.port}"
    generate = "/radixmesh.v1.Worker/Generate"
    message = "radixmesh.v1.WorkerGenerateRequest"
    assert_plain_invalid(refused_raw(target, generate, b"\xff\xff\xff", True), message, CORRUPT)
    # WorkerGenerateRequest: request_id 1, token_ids 2 (packed int64)
    bad_id = field(1, NOT_UTF8) + field(2, bytes([1, 2, 3]))
    assert_plain_invalid(refused_raw(target, generate, bad_id, True), message, BAD_UTF8)
    abort = refused_raw(target, "/radixmesh.v1.Worker/Abort", field(1, NOT_UTF8), False)
    assert_plain_invalid(abort, "radixmesh.v1.AbortRequest", BAD_UTF8)
    # the same port still serves a well-formed request sent as bytes
    answer = call_raw(target, generate, field(1, b"direct") + field(2, bytes([1, 2, 3])), True)
    assert isinstance(answer, list) and answer
    assert serving_pb2.GenerateResponse.FromString(answer[-1]).finished
    assert name in cluster.links.links
    assert_serving_and_no_leak(cluster)


def test_an_empty_chat_sent_as_bytes_is_refused_by_name(cluster: LocalCluster) -> None:
    # field 4 present and empty: the oneof is set to a chat of no messages
    err = refused_raw(cluster.target, "/radixmesh.v1.Serving/Generate", field(4, b""), True)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "messages: is empty; send at least one message"
    assert_serving_and_no_leak(cluster)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes, or a valid request with a few bytes overwritten."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=48))
    request = text_request(draw(st.text(min_size=1, max_size=12)), max_tokens=2)
    body = bytearray(request.SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.integers(0, len(body) - 1))] = draw(st.integers(0, 255))
    return bytes(body)


def test_mangled_bytes_never_get_unknown(cluster: LocalCluster) -> None:
    outcomes: dict[str, int] = {}

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(body=mangled())
    def send(body: bytes) -> None:
        try:
            call_raw(cluster.target, "/radixmesh.v1.Serving/Generate", body, True)
            outcome = "OK"
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            assert "class" not in err.details(), err.details()
            outcome = "not valid" if "not a valid" in err.details() else "field"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    send()
    assert outcomes.get("not valid", 0) > 5, outcomes
    assert_serving_and_no_leak(cluster)


# -- authentication comes first ---------------------------------------------------------------


def test_without_a_token_garbage_is_unauthenticated_with_one_invalid(tiny: LoadedModel) -> None:
    guarded = start_cluster(tiny, workers=1, security=SecuritySection(auth_tokens={TOKEN: "*"}))
    try:
        for method, streaming in (
            ("/radixmesh.v1.Serving/Generate", True),
            ("/radixmesh.v1.Serving/Abort", False),
        ):
            anonymous = refused_raw(guarded.target, method, b"\xff\xff\xff", streaming)
            assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED, anonymous.details()
            known = refused_raw(guarded.target, method, field(1, NOT_UTF8), streaming, TOKEN)
            assert known.code() == grpc.StatusCode.INVALID_ARGUMENT, known.details()
            assert "not a valid radixmesh.v1." in known.details()
        assert_serving_and_no_leak(guarded, TOKEN)
    finally:
        guarded.close()


# -- the operator's limits ---------------------------------------------------------------------


def with_stops(stops: list[str]) -> serving_pb2.GenerateRequest:
    request = text_request("hello there", max_tokens=3)
    request.sampling.stop.extend(stops)
    return request


def test_stop_strings_are_limited_in_number_and_length(cluster: LocalCluster) -> None:
    err = refused(cluster, with_stops([f"s{i}" for i in range(17)]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "stop: 17 stop strings; at most 16 are allowed"
    err = refused(cluster, with_stops(["ok", "x" * 257]))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "stop[1]: 257 characters; a stop string has at most 256"
    served(cluster, with_stops([f"s{i}" for i in range(15)] + ["x" * 256]))
    assert_serving_and_no_leak(cluster)


def test_an_empty_chat_is_refused_like_an_empty_prompt(cluster: LocalCluster) -> None:
    request = text_request(max_tokens=3)
    request.chat.SetInParent()
    assert request.WhichOneof("prompt") == "chat"
    err = refused(cluster, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "messages: is empty; send at least one message"
    assert_serving_and_no_leak(cluster)


def test_the_default_character_cap_is_checked_before_tokenising(cluster: LocalCluster) -> None:
    cap = DEFAULT_MAX_PROMPT_CHARS
    # Tokenised, this prompt would be refused for its tokens (far beyond max_model_len 512): a
    # refusal for its characters shows the cap was checked first.
    prompt = ("word " * (cap // 5 + 1))[: cap + 1]
    err = refused(cluster, text_request(prompt, max_tokens=2))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"prompt: {cap + 1} characters; the limit is {cap} (max_prompt_chars)"
    half = "word " * (cap // 10 + 1)
    err = refused(cluster, text_request(chat=[("system", half), ("user", half)], max_tokens=2))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    chars = 2 * len(half)
    assert err.details() == f"messages: {chars} characters; the limit is {cap} (max_prompt_chars)"
    assert_serving_and_no_leak(cluster)


def test_configured_limits_are_the_ones_enforced(tiny: LoadedModel) -> None:
    engine = EngineSection(
        **{**vars(ENGINE), "max_stop_strings": 4, "max_stop_chars": 8, "max_prompt_chars": 64}
    )
    tight = start_cluster(tiny, workers=1, engine=engine)
    try:
        err = refused(tight, with_stops(["a", "b", "c", "d", "e"]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "stop: 5 stop strings; at most 4 are allowed"
        err = refused(tight, with_stops(["x" * 9]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "stop[0]: 9 characters; a stop string has at most 8"
        served(tight, with_stops(["a", "b", "c", "x" * 8]))
        err = refused(tight, text_request("y" * 65, max_tokens=2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "prompt: 65 characters; the limit is 64 (max_prompt_chars)"
        served(tight, text_request("y" * 64, max_tokens=2))
        err = refused(tight, text_request(chat=[("system", "s" * 40), ("user", "u" * 25)]))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "messages: 65 characters; the limit is 64 (max_prompt_chars)"
        served(tight, text_request(chat=[("system", "s" * 40), ("user", "u" * 24)], max_tokens=2))
        assert_serving_and_no_leak(tight)
    finally:
        tight.close()


# -- the interceptor's pieces ------------------------------------------------------------------


def test_the_tolerant_deserializer_marks_what_does_not_decode() -> None:
    decode = tolerant(serving_pb2.GenerateRequest.FromString)
    assert decode(field(2, b"hi")) == serving_pb2.GenerateRequest(text="hi")
    assert decode(field(2, NOT_UTF8)) == Undecodable("radixmesh.v1.GenerateRequest", BAD_UTF8)
    assert decode(b"\xff") == Undecodable("radixmesh.v1.GenerateRequest", CORRUPT)
    from google.protobuf.message import DecodeError

    unknown = DecodeError("Error parsing message with type 'a.B': Exceeded the depth")
    assert plain_reason(unknown) == "exceeded the depth"
