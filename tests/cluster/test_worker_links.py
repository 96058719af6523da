"""The router's links against a worker that sends what the router cannot read: an event of an
unknown kind, a tokenizer that does not parse."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from cache import (
    IDENTITY_SCHEME_VERSION,
    BlockHasher,
    CacheConfig,
    CacheNamespace,
    KvEvent,
    SequenceCache,
)
from cluster.config import ClusterConfig
from cluster.policies import build_policy
from cluster.worker_links import ChannelClosed, TokenizerUnavailable, WorkerLinks
from protos.radixmesh.v1 import worker_pb2, worker_pb2_grpc
from worker.event_loop import EventLoopThread
from worker.grpc_server import start_server


class OddWorker(worker_pb2_grpc.WorkerServicer):
    """Describes itself correctly, then streams an event of a kind no router knows."""

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker="odd", identity_version=IDENTITY_SCHEME_VERSION, block_size=16,
            page_size=16, total_pages=64, vocab_size=512, max_model_len=512, max_running=4,
        )  # fmt: skip

    async def GetSnapshot(
        self, request: worker_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvSnapshot:
        return worker_pb2.KvSnapshot(seq=0)

    async def GetTokenizer(
        self, request: worker_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenizerFiles:
        return worker_pb2.TokenizerFiles()  # a model without a tokenizer: token ids only

    async def StreamKvEvents(
        self, request: worker_pb2.StreamKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        await asyncio.sleep(0.2)  # after the snapshot: the link is attached by then
        event = worker_pb2.KvEvent(seq=1, kind="compacted", block_hashes=[7])
        yield worker_pb2.KvEventBatch(worker="odd", events=[event])
        await asyncio.sleep(60)


def test_an_unreadable_event_detaches_the_worker() -> None:
    loop = EventLoopThread("worker-links-test")
    try:
        register = [(worker_pb2_grpc.add_WorkerServicer_to_server, OddWorker(), "odd")]
        server = loop.run(start_server(register, "127.0.0.1", 0))
        links = WorkerLinks(build_policy(ClusterConfig()))
        loop.run(links.attach("odd", f"127.0.0.1:{server.port}"))
        assert links.healthy == ["odd"]
        deadline = time.monotonic() + 10
        while links.healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert links.healthy == [], "still routed on an index its feed stopped updating"
        loop.run(links.close())
        loop.run(server.stop(0))
    finally:
        loop.stop()


class BrokenTokenizerWorker(OddWorker):
    async def GetTokenizer(
        self, request: worker_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenizerFiles:
        return worker_pb2.TokenizerFiles(files={"tokenizer.json": "{not json"})


def test_a_worker_whose_tokenizer_does_not_parse_is_refused_by_name() -> None:
    loop = EventLoopThread("worker-links-test")
    try:
        register = [
            (worker_pb2_grpc.add_WorkerServicer_to_server, BrokenTokenizerWorker(), "broken")
        ]
        server = loop.run(start_server(register, "127.0.0.1", 0))
        links = WorkerLinks(build_policy(ClusterConfig()))
        with pytest.raises(TokenizerUnavailable, match="worker broken's tokenizer"):
            loop.run(links.attach("broken", f"127.0.0.1:{server.port}"))
        assert links.healthy == [] and links.tokenizer is None
        assert links.limits is None and links.scheme is None  # a refused worker leaves no trace
        loop.run(server.stop(0))
    finally:
        loop.stop()


class SlowSnapshotWorker(OddWorker):
    async def GetSnapshot(
        self, request: worker_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvSnapshot:
        await asyncio.sleep(5)
        return worker_pb2.KvSnapshot(seq=0)


def test_a_worker_detached_while_it_attaches_ends_the_attach() -> None:
    """A request fails on a worker whose snapshot is still loading and detaches it: the attach
    must end (with ChannelClosed), or the router's membership loop waits on it for good."""
    loop = EventLoopThread("worker-links-test")
    try:
        register = [(worker_pb2_grpc.add_WorkerServicer_to_server, SlowSnapshotWorker(), "slow")]
        server = loop.run(start_server(register, "127.0.0.1", 0))
        links = WorkerLinks(build_policy(ClusterConfig()))

        async def attach_then_detach() -> float:
            attaching = asyncio.create_task(links.attach("slow", f"127.0.0.1:{server.port}"))
            await asyncio.sleep(0.5)
            assert links.healthy == ["slow"] and not attaching.done()
            began = time.monotonic()
            await links.detach("slow")
            with pytest.raises(ChannelClosed, match="detached while attaching"):
                await asyncio.wait_for(attaching, timeout=3)
            return time.monotonic() - began

        assert loop.run(attach_then_detach(), timeout=10) < 3
        assert links.healthy == []
        loop.run(server.stop(0))
    finally:
        loop.stop()


def test_the_routers_hashes_are_the_blocks_the_worker_stores() -> None:
    """One implementation: the hasher the router builds from a worker's `WorkerInfo` computes,
    for the same tokens, exactly the block hashes the worker's cache keeps and publishes."""
    cache = SequenceCache(CacheConfig(64, 2, block_size=4, model_revision="rev@1"))
    stored: list[int] = []

    def keep(event: KvEvent) -> None:
        stored.extend(event.block_hashes)

    cache.events.subscribe(keep)
    ns, tokens = CacheNamespace(adapter="lora-a", tenant="acme"), list(range(300, 318))
    seq = cache.start(tokens, ns)
    cache.commit(seq, len(tokens))
    info = worker_pb2.WorkerInfo(
        worker="w0", identity_version=IDENTITY_SCHEME_VERSION, block_size=4, model_revision="rev@1"
    )
    router = BlockHasher(WorkerLinks(build_policy(ClusterConfig()))._checked("w0", info))
    assert router.hashes(tokens, ns) == stored == seq.block_hashes
    assert len(stored) == 4  # 18 tokens: four whole blocks of 4
