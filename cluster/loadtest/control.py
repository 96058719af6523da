"""The command's calls outside its runs: the `GetStats` probe and the Admin calls.

A failed call becomes a `ServerError`: one line naming the call, the server's status and what
it means (unreachable, credentials refused, no Admin service, a policy the router does not
know), which the command prints before it exits 2.
"""

from __future__ import annotations

import asyncio

import grpc

from cluster.client_auth import TOKEN_ENV
from cluster.loadtest.grpc_api import Target
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc

PROBE_TIMEOUT_S = 5.0
ADMIN_TIMEOUT_S = 30.0
CLEAR_ATTEMPTS = 60
CLEAR_INTERVAL_S = 0.5

UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
CREDENTIALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class ServerError(RuntimeError):
    """The target could not be reached, or refused a call the command needs."""


def _status(err: grpc.aio.AioRpcError) -> str:
    return f"{err.code().name}: {err.details()}"


def probe_error(address: str, err: grpc.aio.AioRpcError) -> ServerError:
    code = err.code()
    if code in UNREACHABLE:
        return ServerError(f"cannot reach {address}: {_status(err)}")
    if code in CREDENTIALS:
        return ServerError(
            f"{address} refused the credentials: {_status(err)} "
            f"(pass a token it knows with --token or ${TOKEN_ENV})"
        )
    return ServerError(f"{address} failed the probe (GetStats): {_status(err)}")


async def probe(target: Target) -> serving_pb2.GetStatsResponse:
    """The router's stats, within `PROBE_TIMEOUT_S`."""
    async with target.channel() as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        try:
            return await stub.GetStats(
                serving_pb2.GetStatsRequest(), metadata=target.metadata, timeout=PROBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as err:
            raise probe_error(target.address, err) from err


def admin_error(
    address: str, call: str, err: grpc.aio.AioRpcError, policy: str | None = None
) -> ServerError:
    code = err.code()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return ServerError(
            f"{address} has no Admin service (Admin.{call}: {code.name}); --compare and --sweep "
            "need a radixmesh router"
        )
    if code in CREDENTIALS:
        return ServerError(
            f"{address} refused Admin.{call}: {_status(err)} (--compare and --sweep need a "
            f"token bound to tenant '*', from --token or ${TOKEN_ENV})"
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT and policy is not None:
        return ServerError(f"{address} refused the policy {policy!r}: {_status(err)}")
    if code in UNREACHABLE:
        return ServerError(f"cannot reach {address} for Admin.{call}: {_status(err)}")
    return ServerError(f"Admin.{call} at {address} failed: {_status(err)}")


async def admin(
    target: Target,
    policy: str | None = None,
    attempts: int = CLEAR_ATTEMPTS,
    interval_s: float = CLEAR_INTERVAL_S,
) -> None:
    """Switch the router to `policy` (if given), then empty every worker's cache. ClearCaches
    is refused while workers still have requests running: it is retried `attempts` times,
    `interval_s` apart."""
    async with target.channel() as channel:
        stub = serving_pb2_grpc.AdminStub(channel)
        if policy is not None:
            try:
                await stub.SetPolicy(
                    serving_pb2.SetPolicyRequest(policy=policy),
                    metadata=target.metadata,
                    timeout=ADMIN_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as err:
                raise admin_error(target.address, "SetPolicy", err, policy) from err
        for attempt in range(1, attempts + 1):
            try:
                await stub.ClearCaches(
                    serving_pb2.ClearCachesRequest(),
                    metadata=target.metadata,
                    timeout=ADMIN_TIMEOUT_S,
                )
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise admin_error(target.address, "ClearCaches", err) from err
                if attempt == attempts:
                    raise ServerError(
                        f"{target.address} still refused Admin.ClearCaches after {attempts} "
                        f"tries, {interval_s:g} s apart: {_status(err)}"
                    ) from err
                await asyncio.sleep(interval_s)  # requests still finishing
