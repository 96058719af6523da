"""worker/error_details.py over a real gRPC call on loopback: the field and the reason travel
in the rich status trailer; a long message goes without one; a trailer that does not decode,
or none, reads as no details."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from worker.error_details import MAX_DETAILED_MESSAGE, details_metadata, refusal_of
from worker.errors import ContextOverflow

METHOD = "/probe.Probe/Refuse"


Queue = list[tuple[str, tuple[tuple[str, str | bytes], ...]]]


@pytest.fixture
def refusing() -> Iterator[tuple[Queue, grpc.Channel]]:
    """A server whose one method refuses with what the test queued: (message, trailer)."""
    queued: Queue = []

    def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
        message, trailer = queued.pop(0)
        context.set_trailing_metadata(trailer)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    handler = grpc.method_handlers_generic_handler(
        "probe.Probe", {"Refuse": grpc.unary_unary_rpc_method_handler(refuse)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield queued, channel
    server.stop(None)


def call(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(METHOD)(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    return err.value


def test_field_and_reason_round_trip_and_odd_trailers_read_as_none(
    refusing: tuple[Queue, grpc.Channel],
) -> None:
    queued, channel = refusing
    code = grpc.StatusCode.INVALID_ARGUMENT
    message = "prompt: 9000 tokens leave no room — für ☃ in a context of 8192"
    queued.append((message, details_metadata(code, message, "prompt", ContextOverflow.reason)))
    assert refusal_of(call(channel)) == ("prompt", ContextOverflow.reason)
    plain = "top_p: must be in (0, 1], got 0"
    queued.append((plain, details_metadata(code, plain, "top_p", None)))
    assert refusal_of(call(channel)) == ("top_p", None)
    queued.append((plain, (("grpc-status-details-bin", b"\xff\x00 not a Status"),)))
    assert refusal_of(call(channel)) == (None, None)
    queued.append((plain, ()))
    assert refusal_of(call(channel)) == (None, None)
    assert refusal_of(grpc.RpcError()) == (None, None)  # no call behind it


def test_a_long_message_goes_without_the_trailer_and_fits_grpcs_headers(
    refusing: tuple[Queue, grpc.Channel],
) -> None:
    """The trailer repeats the message; a long one (an adapter list) would pass the default 8
    KB of headers and turn the refusal into RESOURCE_EXHAUSTED."""
    queued, channel = refusing
    code = grpc.StatusCode.INVALID_ARGUMENT
    long = "namespace.adapter: unknown adapter 'x' (loaded: " + "a" * 6000 + ")"
    assert details_metadata(code, long, "namespace.adapter", None) == ()
    queued.append((long, details_metadata(code, long, "namespace.adapter", None)))
    err = call(channel)
    assert err.details() == long and refusal_of(err) == (None, None)  # type: ignore[attr-defined]
    edge = "prompt: " + "b" * (MAX_DETAILED_MESSAGE - len("prompt: "))
    assert details_metadata(code, edge, "prompt", None) != ()
