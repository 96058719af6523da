"""What the router knows of its workers' vision model (cluster/model_vision.py), learnt over real
gRPC from workers that describe themselves, and the parity of an image prompt's routing blocks
with the blocks a worker's cache stores for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

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
from cluster.images import image_cache_keys, prompt_images
from cluster.model_vision import ModelVision
from cluster.policies import build_policy
from cluster.worker_links import IdentityRefused, WorkerLinks
from protos.radixmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.worker.vlm_fixtures import png_bytes
from worker.event_loop import EventLoopThread
from worker.grpc_server import GrpcServer, start_server
from worker.image_prompt import ImagePromptSpec, cache_tokens, expand_ids
from worker.images import ImageLimits, check_images

SPEC = ImagePromptSpec(image_token_id=7, image_seq_len=4, tile_size=32, longest_edge=64)
DEFAULT_LIMITS = ImageLimits()


def vision_info(
    spec: ImagePromptSpec = SPEC, limits: ImageLimits = DEFAULT_LIMITS
) -> worker_pb2.VisionInfo:
    return worker_pb2.VisionInfo(
        image_token_id=spec.image_token_id, image_seq_len=spec.image_seq_len,
        tile_size=spec.tile_size, longest_edge=spec.longest_edge,
        do_image_splitting=spec.do_image_splitting, max_images=limits.max_images,
        max_image_pixels=limits.max_pixels, max_image_bytes=limits.max_bytes,
    )  # fmt: skip


class DescribedWorker(worker_pb2_grpc.WorkerServicer):
    """A worker that describes itself as told (a vision model or not) and stays quiet."""

    def __init__(self, vision: worker_pb2.VisionInfo | None) -> None:
        self.vision = vision

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker="w", identity_version=IDENTITY_SCHEME_VERSION, block_size=4, page_size=4,
            total_pages=64, vocab_size=512, max_model_len=512, max_running=4, vision=self.vision,
        )  # fmt: skip

    async def GetSnapshot(
        self, request: worker_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvSnapshot:
        return worker_pb2.KvSnapshot(seq=0)

    async def GetTokenizer(
        self, request: worker_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenizerFiles:
        return worker_pb2.TokenizerFiles()

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Load:
        return worker_pb2.Load()

    async def StreamKvEvents(
        self, request: worker_pb2.StreamKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        await asyncio.sleep(3600)
        yield worker_pb2.KvEventBatch()


@pytest.fixture
def loop() -> Iterator[EventLoopThread]:
    loop = EventLoopThread("model-vision-test")
    yield loop
    loop.stop()


def serve(loop: EventLoopThread, vision: worker_pb2.VisionInfo | None) -> GrpcServer:
    register = [(worker_pb2_grpc.add_WorkerServicer_to_server, DescribedWorker(vision), "w")]
    return loop.run(start_server(register, "127.0.0.1", 0))


def test_the_cluster_takes_the_smallest_image_limits_and_refuses_another_spec(
    loop: EventLoopThread,
) -> None:
    servers = [
        serve(loop, vision_info(limits=ImageLimits(3, 10_000, 5_000))),
        serve(loop, vision_info(limits=ImageLimits(5, 8_000, 7_000))),
        serve(loop, vision_info(ImagePromptSpec(7, 4, 32, 128))),  # another longest edge
        serve(loop, None),  # a text model
    ]
    links = WorkerLinks(build_policy(ClusterConfig()))
    try:
        for name, server in zip(("a", "b"), servers, strict=False):
            loop.run(links.attach(name, f"127.0.0.1:{server.port}"))
        assert links.limits is not None
        assert links.limits.vision == ModelVision(SPEC, ImageLimits(3, 8_000, 5_000))
        with pytest.raises(IdentityRefused, match="places images as"):
            loop.run(links.attach("c", f"127.0.0.1:{servers[2].port}"))
        with pytest.raises(IdentityRefused, match="serves a text model, the cluster a vision"):
            loop.run(links.attach("d", f"127.0.0.1:{servers[3].port}"))
        assert links.healthy == ["a", "b"]  # the refused leave no trace
        assert links.limits.vision == ModelVision(SPEC, ImageLimits(3, 8_000, 5_000))
    finally:
        loop.run(links.close())
        for server in servers:
            loop.run(server.stop(0))


def test_a_text_cluster_refuses_a_vision_worker(loop: EventLoopThread) -> None:
    text, vision = serve(loop, None), serve(loop, vision_info())
    links = WorkerLinks(build_policy(ClusterConfig()))
    try:
        loop.run(links.attach("text", f"127.0.0.1:{text.port}"))
        assert links.limits is not None and links.limits.vision is None
        with pytest.raises(IdentityRefused, match="serves a vision model, the cluster a text"):
            loop.run(links.attach("vision", f"127.0.0.1:{vision.port}"))
    finally:
        loop.run(links.close())
        loop.run(text.stop(0))
        loop.run(vision.stop(0))


def test_a_vision_description_no_model_could_have_is_refused(loop: EventLoopThread) -> None:
    zero_images = vision_info()
    zero_images.max_images = 0
    zero, tight = serve(loop, zero_images), serve(loop, vision_info(limits=ImageLimits(1, 1, 1)))
    links = WorkerLinks(build_policy(ClusterConfig()))
    try:
        with pytest.raises(IdentityRefused, match="vision description"):
            loop.run(links.attach("zero", f"127.0.0.1:{zero.port}"))
        assert links.limits is None and links.healthy == []
        loop.run(links.attach("tight", f"127.0.0.1:{tight.port}"))  # small, but a model's
        assert links.limits is not None and links.limits.vision is not None
    finally:
        loop.run(links.close())
        loop.run(zero.stop(0))
        loop.run(tight.stop(0))


def test_an_image_prompts_routing_blocks_are_the_blocks_the_worker_stores() -> None:
    """The router hashes `image_cache_keys` of the expanded ids; the worker's cache starts the
    sequence with `cache_tokens` (one ImageToken per tile run) and publishes its blocks: the
    same hashes, so the router's index predicts the worker's hits on images."""
    cache = SequenceCache(CacheConfig(256, 2, block_size=4, model_revision="rev@1"))
    stored: list[int] = []

    def keep(event: KvEvent) -> None:
        stored.extend(event.block_hashes)

    cache.events.subscribe(keep)
    images = check_images([png_bytes(48, 40, 1)], "images", ImageLimits())

    def encode(expansion: str) -> list[int]:  # a toy tokenizer: any ids but the image's do
        ids: list[int] = []
        for i, piece in enumerate(expansion.split("<image>")):
            ids.extend([SPEC.image_token_id] if i else [])
            ids.extend(100 + ord(c) % 100 for c in piece)
        return ids

    ids = expand_ids([1, 2, 3, SPEC.image_token_id, 4, 5], prompt_images(images), SPEC, encode)
    ns = CacheNamespace(tenant="acme")
    seq = cache.start(cache_tokens(ids, prompt_images(images), SPEC), ns)
    cache.commit(seq, len(ids))
    info = worker_pb2.WorkerInfo(
        worker="w0", identity_version=IDENTITY_SCHEME_VERSION, block_size=4, model_revision="rev@1"
    )
    router = BlockHasher(WorkerLinks(build_policy(ClusterConfig()))._checked("w0", info))
    routed = router.hashes(image_cache_keys(ids, images, SPEC), ns)
    assert routed == stored == seq.block_hashes
    assert len(routed) == len(ids) // 4
    assert routed != router.hashes(ids, ns)  # not the ids alone
