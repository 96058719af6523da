"""A vision prompt's images inside the engine: their cache tokens, and the input embeddings of
the image positions a prefill chunk computes. Engine thread, except `place` (the submitting
thread: hashing an image's tiles never runs on the engine's).

A request's images are placed once, at submit: the runs of image tokens in its expanded ids
(`image_runs`: (start, image, tile)) and the prompt as cache tokens (one `ImageToken` per tile
run), which its sequences start the cache with instead of the ids, so a later request that
sends the same image matches its KV position for position:

    ids      [ text ... | <image> x L (tile 0) | text | <image> x L (tile 1) | ... | text ]
    cache    [ text ... | ImageToken(tile 0)   | text | ImageToken(tile 1)   | ... | text ]

A chunk of prefill [start, end) that covers image positions gets their embeddings: row k of
`Vision.encode(image)` is the input embedding of the image's k-th image position (tile
`k // L`, offset `k % L`). The encoder runs lazily: only for an image that a chunk computes,
which a cached prefix covering the image never is. Its output is held by the request while it
prefills (an image split over chunks is encoded once) and kept in the `EncoderCache`, so an
image whose KV was evicted, or a cached prefix ending inside an image, costs no second run.

The encoder runs on a thread of its own (`ImageEmbedder.ready` starts it), not on the engine's:
encoding a frame takes seconds on a CPU (1.8 s for SmolVLM-256M's 512-pixel tile here), and on
the engine thread every other stream's decode would wait that long. A chunk whose images are
still being encoded sits out the steps until they are done; the engine waits for the encoder
only when nothing else can run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cache import CacheToken
from worker.encoder_cache import EncoderCache
from worker.image_prompt import ImagePromptSpec, cache_tokens, image_runs
from worker.images import CheckedImage
from worker.validation import prompt_images


class ImageEncoder(Protocol):
    """What the engine needs of a vision model (worker/vision.py's `Vision`)."""

    @property
    def spec(self) -> ImagePromptSpec: ...

    def encode(self, image: CheckedImage) -> torch.Tensor:
        """[tiles * spec.image_seq_len, hidden]: row k embeds the image's k-th image position."""
        ...


@dataclass(eq=False)
class RequestImages:
    """One request's images, placed in its prompt."""

    images: Sequence[CheckedImage]
    runs: Sequence[tuple[int, int, int]]
    """(start position, image index, tile index) of each run of image tokens, in order."""
    cache_prompt: list[CacheToken]
    """The prompt as cache tokens (text ids, one ImageToken per run)."""
    prompt_length: int
    """Positions of the prompt the runs lie in (`cache_prompt` covers exactly these)."""
    seq_len: int
    """Positions of one run (`image_seq_len`)."""
    salt: object = None
    """What keeps one tenant's encoder outputs from another's (the tenant)."""
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)
    """Encoder outputs by image index, held while the request prefills."""
    encoding: dict[int, Future[tuple[torch.Tensor, float]]] = field(default_factory=dict)
    """Encoder runs under way on the encoder thread, by image index: (output, seconds)."""

    @property
    def end(self) -> int:
        """The position after the last image position."""
        return self.runs[-1][0] + self.seq_len if self.runs else 0

    def cache_tokens(self, tokens: Sequence[int]) -> list[CacheToken]:
        """A sample's tokens (the prompt's ids, then generated ones) as cache tokens."""
        return [*self.cache_prompt, *tokens[self.prompt_length :]]

    def rows(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """(image, first row of its output, first row of the chunk, count) of every stretch of
        image positions in [start, end)."""
        out = []
        length = self.seq_len
        for run_start, image, tile in self.runs:
            lo, hi = max(start, run_start), min(end, run_start + length)
            if lo < hi:
                out.append((image, tile * length + lo - run_start, lo - start, hi - lo))
        return out


def place(
    ids: Sequence[int],
    prompt_length: int,
    images: Sequence[CheckedImage],
    spec: ImagePromptSpec,
    salt: object = None,
) -> RequestImages:
    """Place checked images in expanded ids whose first `prompt_length` are the prompt's
    (a resumed sample's end with generated tokens). Raises InvalidRequest("images", ...)."""
    placed = prompt_images(images)
    prompt = ids[:prompt_length]
    runs = image_runs(prompt, placed, spec)
    return RequestImages(
        images, runs, cache_tokens(prompt, placed, spec), prompt_length, spec.image_seq_len, salt
    )


EncoderRun = Future[tuple[torch.Tensor, float]]
"""An encoder run on the encoder's thread: (output, seconds)."""


def _nothing() -> None:
    pass


@dataclass
class EncoderStats:
    runs: int = 0
    """Images encoded."""
    cache_hits: int = 0
    """Images whose output came from the encoder cache instead of a run."""
    seconds: float = 0.0
    """Time spent encoding."""


class ImageEmbedder:
    """Embeddings of a chunk's image positions, from the held outputs, the encoder cache or the
    encoder (on its own thread), in that order. Engine thread, but for the encoder runs."""

    def __init__(
        self, encoder: ImageEncoder, cache_bytes: int, on_encoded: Callable[[], None] = _nothing
    ) -> None:
        """`on_encoded` is called on the encoder thread after each run (the engine wakes)."""
        self.encoder = encoder
        self.cache = EncoderCache(cache_bytes)
        self.stats = EncoderStats()
        self.on_encoded = on_encoded
        self._thread: ThreadPoolExecutor | None = None
        self._running: dict[tuple[object, int], Future[tuple[torch.Tensor, float]]] = {}
        """Runs not yet swept, by (tenant, image): a second request of the same image shares
        one."""
        self._holders: dict[tuple[object, int], int] = {}
        """Requests waiting for each run in `_running`."""

    def ready(self, request: RequestImages, start: int, end: int) -> bool:
        """Whether every image the chunk [start, end) covers has its output held, taking it
        from the encoder cache or a finished run; starts the runs still needed. A failed run
        raises its error here (the engine ends that request alone)."""
        ready = True
        for image, _, _, _ in request.rows(start, end):
            ready = self._collect(request, image) and ready
        return ready

    def wait(self, requests: Sequence[RequestImages], timeout: float) -> None:
        """Block until one of `requests`' encoder runs finishes, or `timeout` seconds."""
        running = [f for r in requests for f in r.encoding.values()]
        if running:
            wait(running, timeout, return_when=FIRST_COMPLETED)

    def chunk_embeds(
        self, request: RequestImages, start: int, end: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """(chunk rows, [rows, hidden] embeddings) of the image positions in [start, end);
        ([], None) when there are none. Every image they cover must be `ready`."""
        stretches = request.rows(start, end)
        if not stretches:
            return [], None
        offsets: list[int] = []
        pieces = []
        for image, first, chunk_row, count in stretches:
            output = request.encoded[image]
            offsets.extend(range(chunk_row, chunk_row + count))
            pieces.append(output[first : first + count])
        return offsets, torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def close(self) -> None:
        """Stop the encoder thread (a run under way finishes; nobody reads it)."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
        self._running.clear()
        self._holders.clear()

    def release(self, request: RequestImages) -> None:
        """`request` ended before collecting its runs (aborted, cancelled): a run no other
        request waits for is cancelled if it has not started; one under way finishes into the
        encoder cache."""
        for index, run in list(request.encoding.items()):
            self._drop_holder((request.salt, request.images[index].content_hash), run)
        request.encoding.clear()
        self._sweep()

    def _collect(self, request: RequestImages, index: int) -> bool:
        if index in request.encoded:
            return True
        image = request.images[index]
        key = (request.salt, image.content_hash)
        run = request.encoding.get(index)
        if run is None:
            self._sweep()
            output = self.cache.get(key)
            if output is not None:
                self.stats.cache_hits += 1
                request.encoded[index] = output
                return True
            run = self._running.get(key)  # the same image of the same tenant, under way
            if run is None:
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="vision-encoder")
                run = self._running[key] = self._thread.submit(self._encode, image)
            self._holders[key] = self._holders.get(key, 0) + 1
            request.encoding[index] = run
        if not run.done():
            return False
        del request.encoding[index]
        self._drop_holder(key, run)
        self._sweep()
        output, _ = run.result()  # raises the run's error
        tiles = len([r for r in request.runs if r[1] == index])
        if output.shape[0] != tiles * request.seq_len:
            raise RuntimeError(
                f"the vision encoder gave {output.shape[0]} rows for an image of {tiles} "
                f"tiles of {request.seq_len} positions"
            )
        request.encoded[index] = output
        return True

    def _drop_holder(self, key: tuple[object, int], run: EncoderRun) -> None:
        left = self._holders.get(key, 0) - 1
        if left > 0:
            self._holders[key] = left
            return
        self._holders.pop(key, None)
        if self._running.get(key) is run and run.cancel():  # queued, and nobody waits for it
            del self._running[key]

    def _sweep(self) -> None:
        """Finished runs leave `_running`: an output goes into the encoder cache (counted as a
        run), a failure is dropped (its holders read it from their futures; a later request
        for the image runs the encoder again)."""
        for key, run in list(self._running.items()):
            if not run.done():
                continue
            del self._running[key]
            if run.cancelled() or run.exception() is not None:
                continue
            output, seconds = run.result()
            self.stats.runs += 1
            self.stats.seconds += seconds
            self.cache.put(key, output)

    def _encode(self, image: CheckedImage) -> tuple[torch.Tensor, float]:
        began = time.perf_counter()
        try:
            return self.encoder.encode(image), time.perf_counter() - began
        finally:
            self.on_encoded()
