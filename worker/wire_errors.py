"""Requests that do not decode are refused with INVALID_ARGUMENT and a plain message.

Left to grpc, bytes that are not the method's message (corrupt or truncated protobuf, a string
field holding invalid UTF-8) end the call with UNKNOWN and "Unexpected <class
'google.protobuf.message.DecodeError'>: ...". `WireErrorInterceptor` wraps each unary-unary and
unary-stream handler: its request deserializer turns a decode failure into a marker, and its
behaviour answers a marker with INVALID_ARGUMENT, "the request is not a valid <message>:
<reason>". A request that decodes reaches the servicer unchanged.

`start_server` installs it innermost, after any other interceptor (the bearer-token check): an
unauthenticated caller gets UNAUTHENTICATED whatever it sent, and learns nothing of the API.
Stream-request handlers (server reflection) are left as grpc builds them.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

REASONS = {
    "String field had bad UTF-8": "a string field holds invalid UTF-8",
    "Wire format was corrupt": "the bytes are not a well-formed protobuf encoding",
}
"""upb's decode statuses in plain words; any other is passed on in upb's own words."""


@dataclass(frozen=True)
class Undecodable:
    """What the wrapped deserializer returns for bytes that are not the message."""

    message: str
    reason: str

    @property
    def details(self) -> str:
        return f"the request is not a valid {self.message}: {self.reason}"


def plain_reason(error: DecodeError) -> str:
    """upb's "Error parsing message with type 'X': <status>" as a reason a caller can read."""
    _, _, status = str(error).rpartition("': ")
    status = status.strip() or "it does not decode"
    return REASONS.get(status, status[:1].lower() + status[1:])


def _message_name(deserializer: Callable[[bytes], Any]) -> str:
    """The full protobuf name of what `deserializer` (a generated `FromString`) builds."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request message")


def tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer`, returning an `Undecodable` where it would raise a DecodeError."""
    name = _message_name(deserializer)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:
            return Undecodable(name, plain_reason(error))

    return deserialize


def _refusing_unary(behaviour: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        return await behaviour(request, context)

    return unary


def _refusing_stream(behaviour: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., Any]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
        async with aclosing(behaviour(request, context)) as responses:  # its finally runs now
            async for response in responses:
                yield response

    return stream


def refusing_undecodable(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a tolerant deserializer and a behaviour that refuses what it marks.

    Only async unary-request handlers are wrapped (every radixmesh method is one); any other
    is returned as it is, so grpc answers it as before."""
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary
    if inspect.isasyncgenfunction(behaviour):
        wrapped: Callable[..., Any] = _refusing_stream(behaviour)
    elif inspect.iscoroutinefunction(behaviour):
        wrapped = _refusing_unary(behaviour)
    else:
        return handler
    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    replaced: grpc.RpcMethodHandler = handler._replace(
        request_deserializer=tolerant(handler.request_deserializer), **{kind: wrapped}
    )
    return replaced


class WireErrorInterceptor(grpc.aio.ServerInterceptor):
    """Refuses undecodable requests with INVALID_ARGUMENT (see the module's docstring)."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        """method -> (the handler grpc found, its wrapped form): wrapped once, not per call."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = refusing_undecodable(handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped
