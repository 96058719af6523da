"""radixmesh.v1.Admin: operator calls on the router's port (switch policy, clear caches, load
and unload LoRA adapters on every worker: cluster/adapter_admin.py).

With bearer tokens configured, only a token bound to every tenant ("*") may call them. Used by
`radixmesh loadtest --compare` to run one workload under two policies from cold caches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import grpc

from cluster.adapter_admin import AdapterAdmin
from cluster.auth import allowed_tenant
from cluster.config import ANY_TENANT, ClusterConfig
from cluster.policies import build_policy
from cluster.serving_call import ServingError
from cluster.worker_links import WorkerLinks
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc
from router.errors import UnknownPolicy


async def clear_caches(links: WorkerLinks, on_clear: Callable[[], None] | None = None) -> int:
    """Empty every worker's prefix cache, then what `on_clear` clears in the router (its text
    index); the pages freed, over the workers. A worker with requests running refuses
    (FAILED_PRECONDITION: clear when idle): ServingError naming the first that refused, the
    router's own left as it was (the other workers' are cleared)."""
    named = list(links.links.values())
    request = serving_pb2.ClearCachesRequest()
    answers = await asyncio.gather(
        *(link.stub.ClearCache(request, timeout=10) for link in named), return_exceptions=True
    )
    freed = 0
    for link, answer in zip(named, answers, strict=True):
        if isinstance(answer, grpc.aio.AioRpcError):
            raise ServingError(answer.code(), f"worker {link.name}: {answer.details()}")
        if isinstance(answer, BaseException):
            raise answer
        freed += answer.pages_freed
    if on_clear is not None:
        on_clear()
    return freed


class AdminService(serving_pb2_grpc.AdminServicer):
    def __init__(
        self,
        links: WorkerLinks,
        config: ClusterConfig,
        on_clear: Callable[[], None] | None = None,
        adapters: AdapterAdmin | None = None,
    ) -> None:
        self.links = links
        self.config = config
        self.on_clear = on_clear
        """What ClearCaches clears in the router itself (its text index)."""
        self.adapters = adapters or AdapterAdmin(links, config)
        """Shared with the HTTP API (the router service's): one change at a time."""

    async def _require_admin(self, context: grpc.aio.ServicerContext) -> None:
        if allowed_tenant(context, self.config.security) != ANY_TENANT:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "admin calls need a token bound to tenant '*'"
            )

    async def SetPolicy(
        self, request: serving_pb2.SetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.SetPolicyResponse:
        await self._require_admin(context)
        previous = self.links.policy.name
        router = replace(self.config.router, policy=request.policy)
        try:
            policy = build_policy(replace(self.config, router=router))
        except UnknownPolicy as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"policy: {err}")
        await self.links.replace_policy(policy)
        return serving_pb2.SetPolicyResponse(previous=previous)

    async def ClearCaches(
        self, request: serving_pb2.ClearCachesRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ClearCachesResponse:
        await self._require_admin(context)
        freed = 0
        try:
            freed = await clear_caches(self.links, self.on_clear)
        except ServingError as err:
            await context.abort(err.code, err.message)
        return serving_pb2.ClearCachesResponse(pages_freed=freed)

    async def LoadAdapter(
        self, request: serving_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.LoadAdapterResponse:
        await self._require_admin(context)
        infos = []
        try:
            infos = await self.adapters.load(request.name, request.path)
        except ServingError as err:
            await context.abort(err.code, err.message)
        return serving_pb2.LoadAdapterResponse(adapters=infos)

    async def UnloadAdapter(
        self, request: serving_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.UnloadAdapterResponse:
        await self._require_admin(context)
        answer = serving_pb2.UnloadAdapterResponse()
        try:
            answer = await self.adapters.unload(request.name)
        except ServingError as err:
            await context.abort(err.code, err.message)
        return answer

    async def ListAdapters(
        self, request: serving_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ListAdaptersResponse:
        await self._require_admin(context)
        infos = []
        try:
            infos = await self.adapters.listed()
        except ServingError as err:
            await context.abort(err.code, err.message)
        return serving_pb2.ListAdaptersResponse(adapters=infos)
