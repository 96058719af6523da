"""Vision prompts in the prefix cache, without a model: real image files, checked and placed as
the worker places them (worker/images.py, worker/image_prompt.py), started in a real
SequenceCache with their cache tokens.

A repeated image matches its KV position for position; the same image in two tenants never
shares a page; two different images of equal size never share a key; a cached prefix may end
inside an image and continues from there; the router's block hashes of an image prompt equal
the blocks the worker publishes, yet the worker never takes them as given.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from cache import (
    DEFAULT_NAMESPACE,
    CacheConfig,
    CachedSequence,
    CacheNamespace,
    CacheToken,
    ImageToken,
    SequenceCache,
    to_cache_keys,
)
from cache.integrity import check_sequence_cache
from tests.worker.vlm_fixtures import png_bytes
from worker.image_prompt import ImagePromptSpec, PromptImage, cache_tokens, expand_ids, image_runs
from worker.images import ImageLimits, check_image

SPEC = ImagePromptSpec(image_token_id=513, image_seq_len=4, tile_size=32, longest_edge=64)
"""The tiny checkpoint's placement (tests/worker/vlm_fixtures.py)."""
SMOLVLM = ImagePromptSpec(
    49190, image_seq_len=64, tile_size=512, longest_edge=2048, do_image_splitting=False
)
"""SmolVLM-256M's runs, without splitting: one frame per image."""
TEXT = list(range(100, 120))


def _vocab(spec: ImagePromptSpec) -> Callable[[str], list[int]]:
    """The expansion's special tokens and newlines as ids (the tokenizer's job, without one)."""

    def encode(text: str) -> list[int]:
        return [
            spec.image_token_id if piece == "<image>" else 600 + sum(map(ord, piece)) % 300
            for piece in re.findall(r"<[^>]+>|\n", text)
        ]

    return encode


def placed(seed: int, width: int, height: int) -> PromptImage:
    image = check_image(png_bytes(width, height, seed), "images[0]", ImageLimits())
    return PromptImage(image.content_hash, image.width, image.height)


def prompt(
    image: PromptImage, spec: ImagePromptSpec = SPEC, before: int = 5, after: int = 6
) -> tuple[list[int], list[CacheToken]]:
    """(expanded ids, cache tokens) of text, the image, text."""
    ids = [*TEXT[:before], spec.image_token_id, *TEXT[-after:]]
    expanded = expand_ids(ids, [image], spec, _vocab(spec))
    return expanded, cache_tokens(expanded, [image], spec)


def make(num_pages: int = 512, page_size: int = 1) -> SequenceCache:
    return SequenceCache(CacheConfig(num_pages, page_size, 8, max(4, page_size)))


def run(
    cache: SequenceCache, tokens: list[CacheToken], ns: CacheNamespace, upto: int | None = None
) -> tuple[CachedSequence, list[int]]:
    """Start, compute `upto` positions (all), finish; returns the sequence and its pages."""
    seq = cache.start(tokens, ns)
    cache.take_page_copies(seq)
    pages = list(cache.table.row(seq.slot))
    cache.finish(seq, len(seq.keys) if upto is None else upto)
    check_sequence_cache(cache)
    return seq, pages


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_repeated_image_matches_its_kv_and_the_cache_tokens_cover_every_position(
    page_size: int,
) -> None:
    cache = make(page_size=page_size)
    image = placed(1, 60, 40)  # 2 x 2 tiles and the global image: 5 runs
    ids, tokens = prompt(image)
    assert sum(isinstance(t, ImageToken) for t in tokens) == 5 == SPEC.tiles(60, 40)
    assert len(to_cache_keys(tokens)) == len(ids)
    first, _ = run(cache, tokens, DEFAULT_NAMESPACE)
    assert first.reused == 0
    follow_up = [*tokens, *TEXT[:7]]  # the next turn re-sends the image
    again = cache.start(follow_up)
    assert again.reused == len(ids) - len(ids) % page_size
    cache.abort(again)
    check_sequence_cache(cache)


def test_the_same_image_in_two_tenants_never_shares_pages() -> None:
    cache = make()
    _, tokens = prompt(placed(1, 60, 40))
    acme, other = CacheNamespace(tenant="acme"), CacheNamespace(tenant="other")
    _, acme_pages = run(cache, tokens, acme)
    second, other_pages = run(cache, tokens, other)
    assert second.reused == 0
    assert not set(acme_pages) & set(other_pages)
    assert cache.tree.cached_pages == len(acme_pages) + len(other_pages)
    third = cache.start(tokens, acme)  # and each tenant hits its own
    assert third.reused == len(third.keys) - 1
    assert set(cache.table.row(third.slot)[: third.cached_pages]) <= set(acme_pages)
    cache.abort(third)


def test_two_different_images_of_equal_size_never_collide() -> None:
    cache = make()
    a, b = placed(1, 60, 40), placed(2, 60, 40)
    assert (a.width, a.height) == (b.width, b.height) and a.content_hash != b.content_hash
    ids_a, tokens_a = prompt(a)
    ids_b, tokens_b = prompt(b)
    assert ids_a == ids_b  # the same ids: only the cache tokens tell the images apart
    keys_a, keys_b = to_cache_keys(tokens_a), to_cache_keys(tokens_b)
    runs = image_runs(ids_a, [a], SPEC)
    image_positions = {s + i for s, _, _ in runs for i in range(SPEC.image_seq_len)}
    assert not {keys_a[p] for p in image_positions} & {keys_b[p] for p in image_positions}
    run(cache, tokens_a, DEFAULT_NAMESPACE)
    seq = cache.start(tokens_b)
    assert seq.reused == runs[0][0]  # the text before the first image position, no further
    cache.abort(seq)
    # and the tiles of one image never stand for each other
    tiles = [t for t in tokens_a if isinstance(t, ImageToken)]
    assert len({t.content_hash for t in tiles}) == len(tiles)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_cached_prefix_may_end_inside_an_image(page_size: int) -> None:
    cache = make(page_size=page_size)
    image = placed(3, 24, 20)  # one frame: the global image alone
    ids, tokens = prompt(image, SMOLVLM, before=3, after=4)
    ((start, _, _),) = image_runs(ids, [image], SMOLVLM)
    cut = start + 21  # inside the image's 64 positions
    run(cache, tokens, DEFAULT_NAMESPACE, upto=cut)
    seq = cache.start(tokens)
    assert seq.reused == cut - cut % page_size
    assert start < seq.reused < start + SMOLVLM.image_seq_len
    cache.take_page_copies(seq)
    cache.finish(seq, len(seq.keys))  # the rest of the image computed: now all of it hits
    again = cache.start(tokens)
    assert again.reused == min(len(ids) - 1, len(ids) - len(ids) % page_size)
    cache.abort(again)
    check_sequence_cache(cache)


def test_the_routers_hashes_of_an_image_prompt_are_what_the_worker_publishes() -> None:
    """The router hashes the same cache keys (so a follow-up routes to the worker holding the
    image), but the worker never takes a chain over image keys as given: it hashes them."""
    cache = make(page_size=4)
    _, tokens = prompt(placed(1, 60, 40))
    ns = CacheNamespace(tenant="acme")
    routed = cache.hasher.hashes(to_cache_keys(tokens), ns)
    seq = cache.start(tokens, ns, block_hashes=routed)
    cache.take_page_copies(seq)
    cache.finish(seq, len(seq.keys))
    assert cache.stats.given_blocks == 0
    assert cache.tree.block_set() == set(routed)
    text = cache.start(TEXT, ns, block_hashes=cache.hasher.hashes(TEXT, ns))
    assert cache.stats.given_blocks > 0  # a text prompt's chain is taken: the check can fail
    cache.abort(text)
