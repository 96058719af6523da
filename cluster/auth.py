"""Bearer-token checks on the public port, and the tenant each token may use.

With `security.auth_tokens` set, every call but the standard health check (Kubernetes probes
carry no token) needs `authorization: Bearer <token>` with a known token, or gets
UNAUTHENTICATED. A token is bound to one tenant (or "*" for any): `allowed_tenant` tells the
Generate handler which, so a caller can never reach another tenant's cache.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from cluster.config import ANY_TENANT, SecuritySection

OPEN_METHODS = ("/grpc.health.v1.Health/",)


def bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


def known_token(token: str | None, security: SecuritySection) -> str | None:
    """The configured token equal to `token` (compared in constant time), or None."""
    if token is None:
        return None
    for candidate in security.auth_tokens:
        if hmac.compare_digest(candidate.encode(), token.encode()):
            return candidate
    return None


def allowed_tenant(context: grpc.aio.ServicerContext, security: SecuritySection) -> str:
    if not security.auth_tokens:
        return ANY_TENANT
    token = known_token(bearer_token(context.invocation_metadata()), security)
    assert token is not None, "the interceptor lets no unknown token through"
    return security.auth_tokens[token]


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, security: SecuritySection) -> None:
        self.security = security

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if not self.security.auth_tokens or details.method.startswith(OPEN_METHODS):
            return handler
        if known_token(bearer_token(details.invocation_metadata), self.security) is not None:
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "a valid bearer token is required (metadata 'authorization: Bearer <token>')"

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream is not None:

        async def refuse_stream(request: object, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
