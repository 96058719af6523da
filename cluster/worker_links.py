"""The router's links to its workers: membership, identity checks and the KV-event feed.

`attach(name, address)` connects, asks the worker to Describe itself, refuses it if its cache
identity scheme differs from the cluster's (version, block size, model revision) or its vision
model places images differently (cluster/model_vision.py), takes the
tokenizer from it if the router has none yet (so a router started or restarted anywhere needs
no copy of the checkpoint and nothing from Ray's object store), adds it to the routing policy,
and starts feeding its KV events into the policy: subscribe first, then load a
snapshot (events it already reflects are skipped); a gap in the numbers triggers a new snapshot.
A failing feed or call, or an event the router cannot read (an unknown kind), detaches the
worker (dropped from the policy, index and all: never routed on an index it stopped updating);
whoever knows where the worker lives now (Ray, a test) attaches it again, and it starts from a
snapshot. All on one asyncio loop.

LoRA adapters: every `load_poll_s` (and at attach, and right after an Admin call changes them:
`refresh_adapters`) the router asks each worker for its `Load`, whose adapters (name, identity,
resident or in host memory) and measured swap seconds go to the policy (`report_adapters`) and
make `adapters()`, the name -> identity map requests are checked against. Adapters loaded or
unloaded through the Admin service are remembered (`admin_adapters`) and replayed on a worker
that attaches (a restarted one starts from its config's adapters), before it takes requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import grpc

from cache import (
    IDENTITY_SCHEME_VERSION,
    BlockHasher,
    IdentityScheme,
    KvEvent,
    KvEventKind,
    KvSnapshot,
)
from cluster.model_vision import ModelVision, differs
from cluster.requests import ModelLimits
from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from router.adapters import WorkerAdapters
from router.interface import RoutingPolicy
from worker.grpc_server import INTERNAL_MESSAGE_BYTES
from worker.tokenizer import Tokenizer, TokenizerError

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", INTERNAL_MESSAGE_BYTES),
    # Unbounded here: what the router sends was bounded before (the public message limit, the
    # prompt's context, the images' count and bytes: cluster/requests.py); each worker's server
    # receives up to worker.grpc_server.internal_message_bytes of its own image limits, which
    # are at least the cluster's (the smallest over workers).
    ("grpc.max_send_message_length", -1),
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class IdentityRefused(ValueError):
    """A worker computes block hashes differently from the cluster."""


class TokenizerUnavailable(ValueError):
    """A worker's tokenizer files could not be read into a tokenizer."""


class ChannelClosed(Exception):
    """A call was cut because its worker's channel was closed here (the worker was detached,
    by another call's failure or its KV feed): a failure of that worker, like UNAVAILABLE."""


async def responses(call: AsyncIterable[T]) -> AsyncIterator[T]:
    """A server stream's messages. grpc.aio raises CancelledError from a call cancelled on this
    side, as closing its channel does: unless the task reading it is the one being cancelled
    (its own client went away), that is `ChannelClosed`, never an escaped cancellation, which
    would end the reader's own RPC without a status and leave its client waiting."""
    try:
        async for message in call:
            yield message
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise ChannelClosed("the worker's channel was closed during the call") from None


@dataclass
class WorkerLink:
    name: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.WorkerInfo
    feed: asyncio.Task[None] | None = None
    events_applied: int = 0
    snapshots_loaded: int = 0
    adapters: dict[str, serving_pb2.AdapterInfo] = field(default_factory=dict)
    """The LoRA adapters it holds, by name, as of its last Load."""
    adapter_swap_s: float = 0.0
    poll: asyncio.Task[None] | None = None


@dataclass
class WorkerLinks:
    policy: RoutingPolicy
    on_change: Callable[[], None] = lambda: None
    links: dict[str, WorkerLink] = field(default_factory=dict)
    scheme: IdentityScheme | None = None
    hasher: BlockHasher | None = None
    limits: ModelLimits | None = None
    tokenizer: Tokenizer | None = None
    """The workers' tokenizer, from the first worker attached (None: the model has none)."""
    load_poll_s: float = 0.5
    admin_adapters: dict[str, str | None] = field(default_factory=dict)
    """Adapters changed through the Admin service, name -> path (None: unloaded), in order:
    replayed on each worker that attaches."""
    _adapter_view: dict[str, str] | None = None
    """`adapters()`, kept until a worker's adapters or the membership change."""

    @property
    def healthy(self) -> list[str]:
        return sorted(self.links)

    async def attach(self, name: str, address: str) -> WorkerLink:
        """Connect and start routing to a worker (replacing any previous link of that name)."""
        await self.detach(name)
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            info = await stub.Describe(worker_pb2.DescribeRequest(), timeout=10)
            scheme = self._checked(name, info)
            if self.tokenizer is None:
                self.tokenizer = await self._fetch_tokenizer(name, stub)
            await self._replay_adapters(name, stub)
        except (grpc.aio.AioRpcError, IdentityRefused, TokenizerUnavailable):
            await channel.close()
            raise
        if self.scheme is None:  # the first worker sets the cluster's scheme
            self.scheme, self.hasher = scheme, BlockHasher(scheme)
        self.limits = self._limits_with(info)  # after the await: another attach may have run
        link = WorkerLink(name, address, channel, stub, info)
        self.links[name] = link
        self.policy.add_worker(name, info.total_pages * info.page_size)
        ready = asyncio.get_running_loop().create_future()
        link.feed = asyncio.create_task(self._feed(link, ready), name=f"kv-events-{name}")
        await ready
        await self._poll_load(link)
        link.poll = asyncio.create_task(self._keep_polling(link), name=f"load-{name}")
        self.on_change()
        return link

    # -- LoRA adapters -------------------------------------------------------------------------
    def adapters(self) -> dict[str, str]:
        """name -> identity of every adapter a healthy worker holds. Workers that disagree (a
        reload under way) give the identity most of them hold (ties: the smallest), which only
        decides the router's hashes: each worker checks them against its own."""
        if self._adapter_view is None:
            self._adapter_view = self._vote_adapters()
        return self._adapter_view

    def _vote_adapters(self) -> dict[str, str]:
        votes: dict[str, dict[str, int]] = {}
        for link in self.links.values():
            for name, info in link.adapters.items():
                counts = votes.setdefault(name, {})
                counts[info.identity] = counts.get(info.identity, 0) + 1
        return {
            name: min(counts, key=lambda identity: (-counts[identity], identity))
            for name, counts in votes.items()
        }

    async def refresh_adapters(self) -> None:
        """Every worker's adapters as of now (after an Admin call changed them)."""
        await asyncio.gather(*(self._poll_load(link) for link in list(self.links.values())))

    async def _poll_load(self, link: WorkerLink) -> None:
        """Ask the worker for its Load; its adapters go to the link and the policy. A failing
        call changes nothing (the KV feed decides whether the worker is gone)."""
        try:
            load = await link.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        except grpc.aio.AioRpcError as err:
            log.debug("GetLoad of %s failed: %s", link.name, err.code())
            return
        if self.links.get(link.name) is not link:  # detached meanwhile
            return
        adapters = {info.name: info for info in load.adapters}
        if adapters != link.adapters:
            self._adapter_view = None
        link.adapters = adapters
        link.adapter_swap_s = load.adapter_swap_seconds
        self._report_adapters(link)

    def _report_adapters(self, link: WorkerLink) -> None:
        infos = link.adapters.values()
        self.policy.report_adapters(
            link.name,
            WorkerAdapters.of(
                (i.identity for i in infos),
                (i.identity for i in infos if i.resident),
                link.adapter_swap_s,
            ),
        )

    async def _keep_polling(self, link: WorkerLink) -> None:
        while self.links.get(link.name) is link:
            await asyncio.sleep(self.load_poll_s)
            await self._poll_load(link)

    async def _replay_adapters(self, name: str, stub: worker_pb2_grpc.WorkerStub) -> None:
        """What the Admin service loaded and unloaded, on a worker that joins. A failure is
        logged, not fatal: the worker serves what it holds, and refuses the rest by name."""
        for adapter, path in self.admin_adapters.items():
            try:
                if path is None:
                    await stub.UnloadAdapter(
                        serving_pb2.UnloadAdapterRequest(name=adapter), timeout=30
                    )
                else:
                    await stub.LoadAdapter(
                        serving_pb2.LoadAdapterRequest(name=adapter, path=path), timeout=120
                    )
            except grpc.aio.AioRpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise  # the worker itself failed: not attached
                if path is not None:  # (an unload of what it does not hold is no news)
                    log.warning(
                        "worker %s: adapter %s not loaded: %s", name, adapter, err.details()
                    )

    def _checked(self, name: str, info: worker_pb2.WorkerInfo) -> IdentityScheme:
        """The worker's identity scheme; raises IdentityRefused if it hashes blocks differently
        from the cluster, or places images differently (cluster/model_vision.py). Changes
        nothing: a worker refused after this (its tokenizer unreadable, say) leaves no trace."""
        theirs = IdentityScheme(info.block_size, info.model_revision, info.identity_version)
        if info.identity_version != IDENTITY_SCHEME_VERSION:
            raise IdentityRefused(
                f"worker {name} uses identity scheme {info.identity_version}, "
                f"the router {IDENTITY_SCHEME_VERSION}"
            )
        if self.scheme is not None:
            try:
                self.scheme.require_compatible(theirs)
            except ValueError as err:
                raise IdentityRefused(f"worker {name}: {err}") from err
        try:
            vision = ModelVision.of(info)
        except ValueError as err:
            raise IdentityRefused(f"worker {name}: its vision description: {err}") from err
        if self.limits is not None:
            problem = differs(self.limits.vision, vision)
            if problem:
                raise IdentityRefused(f"worker {name}: {problem}")
        return theirs

    def _limits_with(self, info: worker_pb2.WorkerInfo) -> ModelLimits:
        """The cluster's limits with this worker counted in: the smallest of each (its vision
        model's spec is the cluster's: `_checked` said so)."""
        vision = ModelVision.of(info)
        if self.limits is None:
            return ModelLimits(
                info.vocab_size, info.max_model_len, vision, info.hidden_size, info.cache_salts
            )
        if vision is not None and self.limits.vision is not None:
            vision = self.limits.vision.smallest(vision)
        return ModelLimits(
            min(self.limits.vocab_size, info.vocab_size),
            min(self.limits.max_model_len, info.max_model_len),
            vision,
            min(self.limits.hidden_size, info.hidden_size),
            self.limits.cache_salts and info.cache_salts,
        )

    @staticmethod
    async def _fetch_tokenizer(name: str, stub: worker_pb2_grpc.WorkerStub) -> Tokenizer | None:
        answer = await stub.GetTokenizer(worker_pb2.GetTokenizerRequest(), timeout=30)
        if not answer.files:
            return None
        try:  # parsing a large tokenizer.json takes a while: not on the event loop
            return await asyncio.to_thread(Tokenizer.from_files, dict(answer.files))
        except TokenizerError as err:
            raise TokenizerUnavailable(f"worker {name}'s tokenizer: {err}") from err

    async def detach(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is None:
            return
        self._adapter_view = None
        self.policy.remove_worker(name)
        if self.limits is not None and not self.limits.cache_salts:  # was it the one without?
            salts = all(other.info.cache_salts for other in self.links.values())
            self.limits = replace(self.limits, cache_salts=salts)
        try:
            if link.poll is not None and link.poll is not asyncio.current_task():
                link.poll.cancel()
                await asyncio.wait([link.poll])
            if link.feed is not None and link.feed is not asyncio.current_task():
                link.feed.cancel()
                await asyncio.wait([link.feed])  # its end, not its error; our own cancel passes
        finally:
            await link.channel.close()
        self.on_change()
        log.warning("worker %s detached", name)

    async def replace_policy(self, policy: RoutingPolicy) -> None:
        """Route with `policy` from now on; its index starts from each worker's snapshot."""
        self.policy = policy
        for link in list(self.links.values()):
            policy.add_worker(link.name, link.info.total_pages * link.info.page_size)
            self._report_adapters(link)
            await self._load_snapshot(link)
        self.on_change()

    async def close(self) -> None:
        for name in list(self.links):
            await self.detach(name)

    async def _feed(self, link: WorkerLink, ready: asyncio.Future[None]) -> None:
        stream = link.stub.StreamKvEvents(worker_pb2.StreamKvEventsRequest())
        try:
            await self._load_snapshot(link)
            ready.set_result(None)
            async for batch in stream:
                for event in batch.events:
                    kv_event = KvEvent(
                        link.name, event.seq, KvEventKind(event.kind), tuple(event.block_hashes)
                    )
                    if not self.policy.apply_event(link.name, kv_event):
                        await self._load_snapshot(link)
                    link.events_applied += 1
        except Exception as err:  # a failed call, or an event this router cannot read
            if not ready.done():
                ready.set_exception(err)
            why = err.code() if isinstance(err, grpc.aio.AioRpcError) else repr(err)
            log.warning("KV event feed of %s ended: %s", link.name, why)
        finally:
            stream.cancel()
            if not ready.done():  # detached while attaching: `attach` must not wait forever
                ready.set_exception(
                    ChannelClosed(f"worker {link.name} was detached while attaching")
                )
        if self.links.get(link.name) is link:
            await self.detach(link.name)

    async def _load_snapshot(self, link: WorkerLink) -> None:
        message = await link.stub.GetSnapshot(worker_pb2.GetSnapshotRequest(), timeout=10)
        snapshot = KvSnapshot(
            link.name,
            message.seq,
            frozenset(message.block_hashes),
            frozenset(message.host_block_hashes),
            frozenset(message.disk_block_hashes),
        )
        self.policy.load_snapshot(link.name, snapshot)
        link.snapshots_loaded += 1
