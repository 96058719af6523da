"""Performs the cache's queued copies over the KV tensors, layer by layer; on CUDA on a stream of
their own that the forward pass waits on one layer at a time.

A queue of copies (`PageCopy`, `TierCopy`, `SpillCopy`, in the order the cache handed them out)
is issued layer-major: every copy's work on layer 0, then on layer 1, and so on. Pages of
different layers are different memory, so the order that matters, each layer's copies in queue
order, is kept. A `SpillCopy` is a barrier: the copies before it finish, then its pages are read
to the CPU for `spill`, then the rest are issued.

On CUDA (`stream=True`) the copies go on a copy stream: it first waits for the compute stream (a
demotion reads KV the last pass wrote; a promotion may write pages that pass read), then issues
each layer's copies and records that layer's event. The forward pass calls `layer_ready(l)`
before layer l, which makes the compute stream wait for that event only: layer l's attention
reads its promoted pages and its KV write may reuse pages a demotion freed, while the copies of
later layers still run beside it (SGLang's HiCache loads back layer by layer the same way).
Copies that move fewer than `min_stream_bytes` between the tiers (MIN_STREAM_BYTES: most
promotions of a short prompt) stay on the compute stream, after a `join`: there the per-layer
events cost the CPU more than the overlap saves. Without the stream (the CPU, or `stream=False`
to measure against) the same layer-major order runs on the current stream and nothing waits.

Host memory written by a demotion's device-to-host transfers (on either stream) is read by the
CPU only after `host_sync`, which waits for the streams that wrote it; device KV is touched outside
the copy stream only after `join`, which makes the current stream wait for it. A copy that fails
part-way joins what was issued before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from cache import PageCopy
from cache.page_pool import PageIds
from cache.tiers import DEVICE, QueuedCopy, SpillCopy, TierCopy

KvPairs = list[tuple[torch.Tensor, torch.Tensor]]
LayerCopy = Callable[[int], None]
"""One copy's work on one layer (its K and V)."""

MAX_COPY_RUNS = 8
"""Runs of host pages a copy moves one by one (a copy call per run and per layer's K and V); a
promotion of more scattered pages gathers them on the host first, a demotion into more
scattered pages moves the gathered pages to the CPU and scatters them there (the CPU waits).
Chosen, not measured: the H100 runs of the ninth session saw only freshly demoted, consecutive
pages."""


MIN_STREAM_BYTES = 64 << 20
"""Copies moving fewer bytes between the tiers than this go on the compute stream. A launch-bound
pass (as SmolLM2- and Llama-3.2-1B-shaped ones are on an H200: about 10-15 ms of kernel launches)
already hides a short transfer queued ahead of it while the CPU launches its kernels, and the
copy stream costs the CPU an event and a wait per layer. On the twelfth session's H200, over
three runs, 24-34 MB promotions (0.4-0.8 ms of transfer) were 0.6-0.9 ms slower with the stream
in one and within the spread in the others; 189-268 MB ones (3.4-4.9 ms) were 1.6-5.0 ms faster
in 11 of 12 cells. 64 MB (about 1.2 ms at the 55 GB/s measured there) lies between."""


class KvCopier:
    def __init__(
        self,
        kv: KvPairs,
        host_kv: KvPairs,
        stream: bool = True,
        min_stream_bytes: int = MIN_STREAM_BYTES,
    ) -> None:
        self.kv = kv
        self.host_kv = host_kv
        self.device = device = kv[0][0].device
        cuda = stream and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.compute = torch.cuda.current_stream(device) if cuda else None
        """The stream the copies were issued beside (the engine thread's current one)."""
        self.ready = [torch.cuda.Event() for _ in kv] if cuda else []
        """Recorded on the copy stream after each layer's copies."""
        self.min_stream_bytes = min_stream_bytes
        k = kv[0][0]
        self.page_bytes = 2 * len(kv) * k[0].numel() * k.element_size()
        """Bytes of one page's K and V over every layer (the same in either tier)."""
        self.pending = False
        """Copies were issued on the stream that the compute stream has not waited for yet."""
        self.host_writers: list[torch.cuda.Stream] = []
        """Streams that may still be writing host pages (a demotion's transfers)."""

    def perform(
        self,
        copies: Sequence[PageCopy | QueuedCopy],
        spill: Callable[[SpillCopy], None],
    ) -> None:
        """Issue `copies` in order (layer-major between spills); `spill` reads each
        `SpillCopy`'s pages once everything queued before it is done."""
        if not copies:
            return
        segment: list[PageCopy | TierCopy] = []
        for copy in copies:
            if isinstance(copy, SpillCopy):
                self._issue(segment)
                segment = []
                spill(copy)
            else:
                segment.append(copy)
        self._issue(segment)

    def _issue(self, copies: Sequence[PageCopy | TierCopy]) -> None:
        if not copies:
            return
        moved = sum(len(c.src_pages) for c in copies if isinstance(c, TierCopy))
        stream = self.stream if moved * self.page_bytes >= self.min_stream_bytes else None
        if stream is None:
            self.join()  # on the compute stream, after whatever the copy stream still has
        else:
            self.pending = True
        try:
            with self._on(stream):
                layers = [self._layer_copy(copy) for copy in copies]
                for layer in range(len(self.kv)):
                    for copy_layer in layers:
                        copy_layer(layer)
                    if stream is not None:
                        self.ready[layer].record(stream)
        except BaseException:
            self.join()  # layers issued before the failure: no later event to wait for
            raise

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """On `stream`, after what the compute stream has queued so far; None: where we are."""
        if stream is None:
            yield
            return
        self.compute = torch.cuda.current_stream(self.device)
        stream.wait_stream(self.compute)
        with torch.cuda.stream(stream):
            yield

    def layer_ready(self, layer: int) -> None:
        """Make the compute stream wait for `layer`'s copies (the forward pass, before it). The
        compute stream is the one current when the copies were issued: the engine issues them
        and runs the pass on one thread, on its current stream."""
        if self.pending and self.compute is not None:
            self.compute.wait_event(self.ready[layer])

    def forward_done(self) -> None:
        """The forward pass waited for every layer: nothing issued is pending for it."""
        self.pending = False

    def join(self) -> None:
        """Make the current stream wait for everything issued (before touching device KV)."""
        if self.pending and self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.pending = False

    def host_sync(self) -> None:
        """Wait for every write into host pages issued so far, on whichever stream (before the
        CPU reads them)."""
        for stream in self.host_writers:
            stream.synchronize()
        self.host_writers.clear()

    def tier_kv(self, tier: int) -> KvPairs:
        """The (k, v) per layer of `tier`'s pages."""
        kv = self.kv if tier == DEVICE else self.host_kv
        if not kv:
            raise RuntimeError("a copy to or from a host tier this runner does not have")
        return kv

    def _layer_copy(self, copy: PageCopy | TierCopy) -> LayerCopy:
        if not isinstance(copy, TierCopy):
            return self._page_copy(copy)
        src, dst = self.tier_kv(copy.src_tier), self.tier_kv(copy.dst_tier)
        src_device, dst_device = src[0][0].device, dst[0][0].device
        if src_device == dst_device:
            return _same_device(src, dst, copy.src_pages, copy.dst_pages)
        if src_device.type == "cpu":
            return self._promotion(copy, src, dst)
        return self._demotion(copy, src, dst)

    def _page_copy(self, copy: PageCopy) -> LayerCopy:
        n = copy.num_slots

        def run(layer: int) -> None:
            for cache in self.kv[layer]:
                cache[copy.dst, :n] = cache[copy.src, :n]

        return run

    def _promotion(self, copy: TierCopy, src: KvPairs, dst: KvPairs) -> LayerCopy:
        """Host (pinned) to GPU: each run of consecutive host pages straight into a staging tensor
        on the GPU (no CPU wait), or, past MAX_COPY_RUNS runs, the pages gathered on the host
        into one pinned tensor per layer and moved in one transfer; then scattered into the
        device pages. On an H100 a gather of each layer into pageable memory and a transfer of
        it alone added 7.8 ms to a 1,024-token prompt's host hit (34 MB, a Llama-3.2-1B-shaped
        model); a gather into one pinned tensor and one transfer 5.7 ms; runs copied straight
        1.9 ms."""
        device = dst[0][0].device
        dst_index = page_index(copy.dst_pages, device)
        runs = page_runs(copy.src_pages)
        gather = len(runs) > MAX_COPY_RUNS
        src_index = page_index(copy.src_pages, torch.device("cpu")) if gather else None

        def run(layer: int) -> None:
            if gather:
                self.host_sync()  # the CPU gathers from pages the stream may still be writing
            for source, target in zip(src[layer], dst[layer], strict=True):
                shape = (len(copy.src_pages), *source.shape[1:])
                if src_index is None:
                    moved = torch.empty(shape, dtype=source.dtype, device=device)
                    for at, start, count in runs:
                        moved[at : at + count].copy_(source[start : start + count], True)
                else:
                    staging = torch.empty(shape, dtype=source.dtype, pin_memory=True)
                    torch.index_select(source, 0, src_index, out=staging)
                    moved = staging.to(device, non_blocking=True)
                target.index_copy_(0, dst_index, moved)

        return run

    def _demotion(self, copy: TierCopy, src: KvPairs, dst: KvPairs) -> LayerCopy:
        """GPU to host (pinned): the pages gathered on the GPU, then each run of consecutive host
        pages written straight from it (no CPU wait; `host_sync` before the CPU reads them), or,
        past MAX_COPY_RUNS runs, moved to the CPU (which waits) and scattered there."""
        src_index = page_index(copy.src_pages, src[0][0].device)
        runs = page_runs(copy.dst_pages)
        scatter = len(runs) > MAX_COPY_RUNS
        dst_index = page_index(copy.dst_pages, torch.device("cpu")) if scatter else None

        def run(layer: int) -> None:
            for source, target in zip(src[layer], dst[layer], strict=True):
                gathered = source.index_select(0, src_index)
                if dst_index is None:
                    for at, start, count in runs:
                        target[start : start + count].copy_(gathered[at : at + count], True)
                    writer = torch.cuda.current_stream(self.device)
                    if writer not in self.host_writers:
                        self.host_writers.append(writer)
                else:  # the transfer makes the CPU wait for the stream: all before it is done
                    target.index_copy_(0, dst_index, gathered.cpu())

        return run


def _same_device(src: KvPairs, dst: KvPairs, src_pages: PageIds, dst_pages: PageIds) -> LayerCopy:
    device = src[0][0].device
    src_index, dst_index = page_index(src_pages, device), page_index(dst_pages, device)

    def run(layer: int) -> None:
        for source, target in zip(src[layer], dst[layer], strict=True):
            target.index_copy_(0, dst_index, source.index_select(0, src_index))

    return run


def page_runs(pages: PageIds) -> list[tuple[int, int, int]]:
    """(position in `pages`, first page, count) of each run of consecutive page ids (numpy over
    the array in place: no Python step per page)."""
    if not pages:
        return []
    ids = np.frombuffer(pages, dtype=np.int32)
    at = np.flatnonzero(np.diff(ids) != 1) + 1
    at = np.concatenate(([0], at))
    counts = np.diff(np.concatenate((at, [len(ids)])))
    return list(zip(at.tolist(), ids[at].tolist(), counts.tolist(), strict=True))


def page_index(pages: PageIds, device: torch.device) -> torch.Tensor:
    """`pages` (an `array("i")`) as an int64 index tensor on `device` (read in place; an empty
    array, which `frombuffer` refuses, gives an empty index). To a GPU through pinned memory,
    without making the CPU wait for the stream."""
    if not pages:
        return torch.empty(0, dtype=torch.long, device=device)
    index = torch.frombuffer(pages, dtype=torch.int32).to(torch.long)
    if device.type == "cpu":
        return index
    return index.pin_memory().to(device, non_blocking=True)
