"""Loading and unloading LoRA adapters on every worker: what the Admin RPCs and vLLM's HTTP
endpoints (POST /v1/load_lora_adapter, /v1/unload_lora_adapter) both do.

    load(name, path)   every healthy worker loads the PEFT directory (or replaces the weights
                       held under `name`); a refusal by any worker is INVALID_ARGUMENT with its
                       message, the workers named, and a new name is unloaded again from those
                       that took it (nothing is loaded then)
    unload(name)       every worker holding it drops it (its cached KV with it); NOT_FOUND when
                       none holds it
    listed()           every worker's adapters

Each call refreshes the router's view of the workers' adapters before it returns, so a request
sent right after a load is routed to it (no wait for the next Load poll). Loads and unloads are
remembered (`WorkerLinks.admin_adapters`) and replayed on workers that attach later. Errors are
`ServingError`s (cluster/serving_call.py): gRPC status and message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from cluster.config import ClusterConfig, adapter_name_problem
from cluster.serving_call import ServingError
from cluster.worker_links import WorkerLink, WorkerLinks
from protos.radixmesh.v1 import serving_pb2

T = TypeVar("T")
LOAD_TIMEOUT_S = 120.0
"""A worker reads and checks the adapter's safetensors (hundreds of MB for a large rank)."""


class AdapterAdmin:
    def __init__(self, links: WorkerLinks, config: ClusterConfig) -> None:
        self.links = links
        self.base_model = config.model.name
        self._lock = asyncio.Lock()
        """One change at a time: a load and an unload of one name must not interleave."""

    async def load(self, name: str, path: str) -> list[serving_pb2.AdapterInfo]:
        problem = adapter_name_problem(name)
        if problem is None and name == self.base_model:
            problem = f"{name!r} is the base model's name"
        if problem is not None:
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"name: {problem}")
        if not path:
            raise ServingError(grpc.StatusCode.INVALID_ARGUMENT, "path: must not be empty")
        async with self._lock:
            links = self._healthy()
            known = name in self.links.adapters()
            request = serving_pb2.LoadAdapterRequest(name=name, path=path)
            answers = await self._on_each(
                links, lambda link: link.stub.LoadAdapter(request, timeout=LOAD_TIMEOUT_S)
            )
            loaded = [(link, a) for link, a in answers if isinstance(a, serving_pb2.AdapterInfo)]
            failed = [
                (link, a) for link, a in answers if not isinstance(a, serving_pb2.AdapterInfo)
            ]
            if failed:
                if not known:  # nothing stays loaded of a new name
                    unload = serving_pb2.UnloadAdapterRequest(name=name)
                    await self._on_each(
                        [link for link, _ in loaded],
                        lambda link: link.stub.UnloadAdapter(unload, timeout=30),
                    )
                await self.links.refresh_adapters()
                raise _refusal(failed)
            self.links.admin_adapters.pop(name, None)  # re-inserted last: replayed in order
            self.links.admin_adapters[name] = path
            await self.links.refresh_adapters()
        out = []
        for link, info in loaded:
            info.worker = link.name
            out.append(info)
        return out

    async def unload(self, name: str) -> serving_pb2.UnloadAdapterResponse:
        async with self._lock:
            await self.links.refresh_adapters()
            holders = [link for link in self._healthy() if name in link.adapters]
            if not holders:
                loaded = ", ".join(sorted(self.links.adapters())) or "none"
                raise ServingError(
                    grpc.StatusCode.NOT_FOUND, f"name: unknown adapter {name!r} (loaded: {loaded})"
                )
            request = serving_pb2.UnloadAdapterRequest(name=name)
            answers = await self._on_each(
                holders, lambda link: link.stub.UnloadAdapter(request, timeout=30)
            )
            self.links.admin_adapters.pop(name, None)
            self.links.admin_adapters[name] = None
            await self.links.refresh_adapters()
        done = [a for _, a in answers if isinstance(a, serving_pb2.UnloadAdapterResponse)]
        failed = [
            (link, a) for link, a in answers if not isinstance(a, serving_pb2.UnloadAdapterResponse)
        ]
        if failed:
            raise _refusal(failed)
        return serving_pb2.UnloadAdapterResponse(
            workers=len(done), pages_freed=sum(a.pages_freed for a in done)
        )

    async def listed(self) -> list[serving_pb2.AdapterInfo]:
        await self.links.refresh_adapters()
        out = []
        for link in self._healthy():
            for info in link.adapters.values():
                copy = serving_pb2.AdapterInfo()
                copy.CopyFrom(info)
                copy.worker = link.name
                out.append(copy)
        return out

    def _healthy(self) -> list[WorkerLink]:
        links = [self.links.links[name] for name in self.links.healthy]
        if not links:
            raise ServingError(grpc.StatusCode.UNAVAILABLE, "no healthy worker")
        return links

    @staticmethod
    async def _on_each(
        links: list[WorkerLink], call: Callable[[WorkerLink], Awaitable[T]]
    ) -> list[tuple[WorkerLink, T | BaseException]]:
        answers = await asyncio.gather(*(call(link) for link in links), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, grpc.aio.AioRpcError):
                raise answer
        return list(zip(links, answers, strict=True))


def _refusal(failed: list[tuple[WorkerLink, object]]) -> ServingError:
    """One error for the workers that refused: INVALID_ARGUMENT with the first worker's message
    (a bad adapter is refused alike by all), or UNAVAILABLE when a worker failed outright."""
    names = ", ".join(link.name for link, _ in failed)
    err = failed[0][1]
    assert isinstance(err, grpc.aio.AioRpcError)
    details = err.details() or err.code().name
    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServingError(grpc.StatusCode.UNAVAILABLE, f"worker(s) {names} failed: {details}")
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{details} (refused by {names})")
