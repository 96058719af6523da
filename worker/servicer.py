"""The worker's gRPC service: a thin async adapter between protos and the engine thread.

Generate submits token ids (and a vision prompt's image files, which the engine checks and
places again) to the engine and streams its outputs back; a client that goes away
(cancel, deadline, disconnect) aborts the request at once, so its pages are freed. A request may
resume a sample another worker began (`resume`: its ids end with the tokens already streamed).
GetTokenizer hands the checkpoint's tokenizer files to a router that has none. LoadAdapter reads
a PEFT directory on a worker thread (never on the event loop, never on the engine's) and serves
it; UnloadAdapter stops serving one and drops its cached trees; GetLoad reports every adapter
held and the measured time to swap one into a slot. KV events are
subscribed on the engine thread and streamed in batches; snapshots, load and stats are read on
the engine thread too (the cache is only safe there). Errors map to gRPC statuses:
InvalidRequest and AdapterError -> INVALID_ARGUMENT, EngineOverloaded -> RESOURCE_EXHAUSTED,
EngineStopped -> UNAVAILABLE, an unknown adapter to unload -> NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

import grpc
import torch
from safetensors.torch import save as save_tensors

from cache import IDENTITY_SCHEME_VERSION, KvEvent, to_cache_keys
from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from worker import kv_export
from worker.engine import Engine
from worker.error_details import details_metadata
from worker.errors import EngineOverloaded, EngineStopped, InvalidRequest
from worker.kv_persistence import StoreIdentity
from worker.lora_adapter import AdapterError
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams
from worker.tokenizer import tokenizer_files
from worker.wire import (
    adapter_info_to_proto,
    kv_peer_from_proto,
    namespace_from_proto,
    output_to_proto,
    pooling_from_proto,
    resume_from_proto,
    sampling_from_proto,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


def _queue_fed_from_threads() -> tuple[asyncio.Queue[T], Callable[[T], None]]:
    """A queue on the running loop, and the function other threads (the engine's) put into it."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[T] = asyncio.Queue()

    def put(item: T) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    return queue, put


def _spells(sampling: SamplingParams) -> bool:
    """Whether submitting a request runs the tokenizer over text it carries."""
    return bool(sampling.prediction or sampling.bad_words)


def _retrieved(task: asyncio.Task[object]) -> None:
    """A copy nobody awaits any more: its failure is not news (the reader left)."""
    if not task.cancelled():
        task.exception()


def _end_lease(engine: Engine, leasing: concurrent.futures.Future[kv_export.Lease | None]) -> None:
    """End a lease taken for a reader that left before it was handed over."""
    if not leasing.cancelled() and leasing.exception() is None:
        held = leasing.result()
        if held is not None:
            engine.call(partial(kv_export.end, engine, held))


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, name: str, checkpoint: Path | None = None) -> None:
        """`checkpoint`: the model's directory, whose tokenizer files GetTokenizer sends."""
        self.engine = engine
        self.name = name
        self.checkpoint = checkpoint
        self._reads = 0
        """ReadKv calls under way (kv_export.MAX_READS at most)."""

    async def _on_engine(self, function: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.engine.call(function))

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        outputs: asyncio.Queue[RequestOutput]
        outputs, sink = _queue_fed_from_threads()
        try:
            generate = GenerateRequest(
                request.request_id,
                prompt_token_ids=tuple(request.token_ids),
                namespace=namespace_from_proto(request.namespace),
                sampling=sampling_from_proto(request.sampling),
                resume=resume_from_proto(request),
                prompt_block_hashes=tuple(request.prompt_block_hashes),
                images=tuple(request.images),
                priority=request.priority,
                pooling=pooling_from_proto(request),
                kv_peer=kv_peer_from_proto(request),
            )
            # decoding and checking images, compiling a structured output's grammar, and
            # tokenizing a prediction or bad words never stall the event loop (256 bad words
            # of 16,000 characters: 1.8 s of the tiny model's tokenizer)
            sampling = generate.sampling
            if generate.images or sampling.structured is not None or _spells(sampling):
                await self._submit_in_thread(generate, sink)
            else:
                self.engine.submit(generate, sink)
        except InvalidRequest as err:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
            await context.abort(
                code, message, details_metadata(code, message, err.field, err.reason)
            )
        except EngineOverloaded as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except EngineStopped as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        remaining = generate.sampling.n
        try:
            while remaining:
                output = await outputs.get()
                remaining -= output.finished
                yield output_to_proto(output, self.name, request.predicted_cached_tokens)
        finally:
            if remaining:  # the client went away first: free the request's pages now
                self.engine.abort(request.request_id)

    async def _submit_in_thread(
        self, request: GenerateRequest, sink: Callable[[RequestOutput], None]
    ) -> None:
        """`engine.submit` on a worker thread; a client gone meanwhile aborts the request
        once it is queued (an abort queued before it would find nothing to abort)."""
        loop = asyncio.get_running_loop()
        submitted = loop.run_in_executor(None, self.engine.submit, request, sink)
        try:
            await asyncio.shield(submitted)
        except asyncio.CancelledError:
            request_id = request.request_id

            def abort(done: asyncio.Future[int]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self.engine.abort(request_id)

            submitted.add_done_callback(abort)
            raise

    async def ReadKv(
        self, request: worker_pb2.ReadKvRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvPages]:
        """The KV of the cached prefix of `token_ids` past `start`, in chunks of whole pages
        (worker/kv_export.py)."""
        engine = self.engine
        ps = engine.config.page_size
        if self._reads >= kv_export.MAX_READS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._reads} reads of this worker's KV are under way, the most it serves",
            )
        differs = StoreIdentity.of(engine).differences(kv_export.layout_from_proto(request.layout))
        if differs:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "KV layouts differ: " + ", ".join(differs)
            )
        if request.start % ps:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"start {request.start} is not a multiple of the page size {ps}",
            )
        try:
            keys = to_cache_keys(request.token_ids)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: {err}")
        namespace = namespace_from_proto(request.namespace)
        self._reads += 1
        try:
            leasing = engine.call(partial(kv_export.lease, engine, keys, namespace, request.start))
            try:
                held = await asyncio.shield(asyncio.wrap_future(leasing))
            except asyncio.CancelledError:  # the reader left: end the lease once it is taken
                leasing.add_done_callback(partial(_end_lease, engine))
                raise
            if held is None:
                return
            try:
                async with contextlib.aclosing(self._pages(held)) as pages:
                    async for message in pages:
                        yield message
            finally:  # not awaited: the lease ends even when the reader went away (a cancel)
                engine.call(partial(kv_export.end, engine, held))
        finally:
            self._reads -= 1

    async def _pages(self, held: kv_export.Lease) -> AsyncGenerator[worker_pb2.KvPages, None]:
        """The lease's pages in chunks, each copied on the engine thread while the one before
        is serialised and sent."""
        engine, ps = self.engine, self.engine.config.page_size
        step, pages = kv_export.chunk_pages(engine), len(held.pages)
        bounds = [(first, min(first + step, pages)) for first in range(0, pages, step)]

        def copy(first: int, last: int) -> asyncio.Task[tuple[torch.Tensor, torch.Tensor]]:
            read = partial(kv_export.read, engine, held, first, last)
            return asyncio.ensure_future(self._on_engine(read))

        copying = copy(*bounds[0])
        try:
            for i, (first, last) in enumerate(bounds):
                k, v = await copying
                if i + 1 < len(bounds):
                    copying = copy(*bounds[i + 1])
                data = await asyncio.to_thread(save_tensors, {"k": k, "v": v})
                yield worker_pb2.KvPages(
                    start=held.start + first * ps, positions=(last - first) * ps, tensors=data
                )
        finally:
            copying.cancel()  # a copy not begun is never made (one begun ends before the lease)
            copying.add_done_callback(_retrieved)

    async def StreamKvEvents(
        self, request: worker_pb2.StreamKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        events: asyncio.Queue[KvEvent]
        events, subscriber = _queue_fed_from_threads()
        unsubscribe = await self._on_engine(lambda: self.engine.cache.events.subscribe(subscriber))
        try:
            while True:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                yield worker_pb2.KvEventBatch(
                    worker=self.name,
                    events=[
                        worker_pb2.KvEvent(
                            seq=e.seq, kind=e.kind.value, block_hashes=list(e.block_hashes)
                        )
                        for e in batch
                    ],
                )
        finally:
            self.engine.call(unsubscribe)

    async def GetSnapshot(
        self, request: worker_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KvSnapshot:
        snapshot = await self._on_engine(self.engine.kv_snapshot)
        return worker_pb2.KvSnapshot(
            worker=self.name,
            seq=snapshot.seq,
            block_hashes=sorted(snapshot.block_hashes),
            host_block_hashes=sorted(snapshot.host_block_hashes),
            disk_block_hashes=sorted(snapshot.disk_block_hashes),
        )

    async def GetLoad(
        self, request: worker_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.Load:
        queued, adapters = await self._on_engine(
            lambda: (self.engine.queued_prefill_tokens(), self.engine.adapter_states())
        )
        stats = self.engine.stats()
        return worker_pb2.Load(
            queued_prefill_tokens=queued,
            running_sequences=stats.running,
            free_pages=stats.free_pages,
            total_pages=self.engine.cache.pool.usable_pages,
            adapters=[adapter_info_to_proto(a, self.name) for a in adapters],
            adapter_swap_seconds=stats.adapter_swap_seconds,
        )

    async def LoadAdapter(
        self, request: serving_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.AdapterInfo:
        if not request.name or not request.path:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "LoadAdapter needs both a name and a path"
            )
        try:
            state = await asyncio.to_thread(self.engine.load_adapter, request.name, request.path)
        except AdapterError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except EngineStopped as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        return adapter_info_to_proto(state, self.name)

    async def UnloadAdapter(
        self, request: serving_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.UnloadAdapterResponse:
        name = request.name
        try:
            freed = await self._on_engine(lambda: self.engine.unload_adapter(name))
        except KeyError as err:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(err.args[0]))
        return serving_pb2.UnloadAdapterResponse(workers=1, pages_freed=freed)

    async def GetStats(
        self, request: serving_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.WorkerStats:
        return worker_stats(self.engine, self.name)

    async def Describe(
        self, request: worker_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        scheme = self.engine.cache.scheme
        return worker_pb2.WorkerInfo(
            worker=self.name,
            identity_version=IDENTITY_SCHEME_VERSION,
            block_size=scheme.block_size,
            model_revision=scheme.model_revision,
            page_size=self.engine.config.page_size,
            total_pages=self.engine.cache.pool.usable_pages,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.engine.max_model_len,
            max_running=self.engine.config.max_running,
            vision=vision_info(self.engine),
            hidden_size=self.engine.limits.hidden_size,
            cache_salts=True,
        )

    async def Abort(
        self, request: serving_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.AbortResponse:
        found = await self._on_engine(lambda: request.request_id in self.engine.active_requests)
        self.engine.abort(request.request_id)
        return serving_pb2.AbortResponse(found=found)

    async def GetTokenizer(
        self, request: worker_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TokenizerFiles:
        if self.checkpoint is None or self.engine.tokenizer is None:
            return worker_pb2.TokenizerFiles()
        files = await asyncio.to_thread(tokenizer_files, self.checkpoint)
        return worker_pb2.TokenizerFiles(files=files)

    async def ClearCache(
        self, request: serving_pb2.ClearCachesRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ClearCachesResponse:
        def clear() -> int | None:
            if self.engine.cache.live:
                return None
            return self.engine.cache.tree.clear()

        freed = await self._on_engine(clear)
        if freed is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "requests are running; clear when idle"
            )
        return serving_pb2.ClearCachesResponse(pages_freed=freed or 0)


def vision_info(engine: Engine) -> worker_pb2.VisionInfo | None:
    """How the engine's vision model places images and what it accepts (None: no vision)."""
    spec = engine.limits.image_spec
    if spec is None:
        return None
    limits = engine.limits.images
    return worker_pb2.VisionInfo(
        image_token_id=spec.image_token_id,
        image_seq_len=spec.image_seq_len,
        tile_size=spec.tile_size,
        longest_edge=spec.longest_edge,
        do_image_splitting=spec.do_image_splitting,
        max_images=limits.max_images,
        max_image_pixels=limits.max_pixels,
        max_image_bytes=limits.max_bytes,
    )


def worker_stats(engine: Engine, name: str, address: str = "") -> serving_pb2.WorkerStats:
    stats = engine.stats()
    return serving_pb2.WorkerStats(
        worker=name,
        healthy=True,
        requests_finished=stats.requests_finished,
        prompt_tokens=stats.prompt_tokens,
        cached_prompt_tokens=stats.cached_prompt_tokens,
        generated_tokens=stats.generated_tokens,
        running=stats.running,
        waiting=stats.waiting,
        free_pages=stats.free_pages,
        cached_pages=stats.cached_pages,
        private_pages=stats.private_pages,
        evicted_pages=stats.evicted_pages,
        host_total_pages=stats.host_total_pages,
        host_cached_pages=stats.host_cached_pages,
        demoted_pages=stats.demoted_pages,
        promoted_pages=stats.promoted_pages,
        host_evicted_pages=stats.host_evicted_pages,
        host_hit_tokens=stats.host_hit_tokens,
        disk_hit_tokens=stats.disk_hit_tokens,
        disk_skipped_tokens=stats.disk_skipped_tokens,
        peer_read_tokens=stats.peer_read_tokens,
        peer_read_failures=stats.peer_read_failures,
        peer_skipped_tokens=stats.peer_skipped_tokens,
        disk_spilled_pages=stats.disk_spilled_pages,
        disk_spill_skipped_pages=stats.disk_spill_skipped_pages,
        preemptions=stats.preemptions,
        total_pages=engine.cache.pool.usable_pages,
        address=address,
    )
