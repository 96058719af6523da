"""A refusal's details on gRPC, for programs: google.rpc's rich error model, which gRPC
clients in every language read from the `grpc-status-details-bin` trailer (grpcio-status in
Python), beside the status code and the message people read.

A refused field travels as a `google.rpc.BadRequest` field violation (the field, and what was
wrong with it); a refusal a client may act on also names its reason (worker/errors.py) in a
`google.rpc.ErrorInfo` of the domain "radixmesh": `CONTEXT_LENGTH_EXCEEDED` (drop the oldest
turns, or ask for fewer tokens) or `PROMPT_TOO_LARGE` (over the operator's `max_prompt_chars`).
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "radixmesh"
MAX_DETAILED_MESSAGE = 2048
"""The trailer repeats the message (google.rpc.Status must hold it): past this many bytes it is
left out, so that a long refusal stays within gRPC's header limits (8 KB by default)."""

Metadata = tuple[tuple[str, str | bytes], ...]


def details_metadata(
    code: grpc.StatusCode, message: str, field: str | None, reason: str | None
) -> Metadata:
    """The trailer that carries `field` and `reason` (none: nothing to add)."""
    if (field is None and reason is None) or len(message.encode()) > MAX_DETAILED_MESSAGE:
        return ()
    details = []
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=field, description=message.removeprefix(f"{field}: ")
        )
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if reason is not None:
        details.append(_packed(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)))
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    return tuple(rpc_status.to_status(status).trailing_metadata)


def refusal_of(error: grpc.RpcError) -> tuple[str | None, str | None]:
    """(the field, the radixmesh reason) a failed call's trailer carries, each None where it
    carries none (as does a trailer that disagrees with the call's code or message)."""
    try:
        status = rpc_status.from_call(error)
    except Exception:  # a trailer at odds with the call, one that does not decode, no call
        return None, None
    field = reason = None
    for detail in status.details if status is not None else ():
        info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
        if detail.Unpack(info) and info.domain == DOMAIN:
            reason = info.reason
        elif detail.Unpack(bad) and bad.field_violations:
            field = bad.field_violations[0].field
    return field, reason


def _packed(message: error_details_pb2.BadRequest | error_details_pb2.ErrorInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
