"""Where an image's positions go in a prompt, for the Idefics3 / SmolVLM family. Imports no torch.

The router and the worker both expand a prompt's images with this module, so both compute the
same token ids, the same cache keys and the same block hashes. A prompt marks each image with
one `<image>` (the processor's image token): in a text prompt literally, in a chat as an image
part (the chat template writes `<image>`), in token ids as the image token's id. Expanding an
image whose resized grid is `rows x cols` tiles writes, as transformers' Idefics3Processor does:

    rows = cols = 0:   <fake_token_around_image><global-img><image>*L<fake_token_around_image>
    otherwise:         for each row r, col c: <fake_token_around_image><row_r_col_c><image>*L
                       then "\\n" after each row, then
                       "\\n<fake_token_around_image><global-img><image>*L<fake_token_around_image>"

where L = `image_seq_len` positions per tile. The grid follows the image processor exactly
(resize the longest edge to `size.longest_edge`, cap at 4096, round both sides up to whole tiles
of `max_image_size.longest_edge`), so it is known from the image's size alone.

In the cache each tile's run of L positions is one `ImageToken` (seed 000): its content hash is
128 bits of blake2b over the image's identity and the tile's place, its KV length L. A repeated
image therefore matches position for position, and two images never share a key.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cache import CacheToken, ImageToken
from worker.errors import InvalidRequest

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"
MAX_IMAGE_SIDE = 4096
"""transformers' Idefics3 MAX_IMAGE_SIZE: no side is resized above it."""
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class ImagePromptSpec:
    """What a vision model's processor does with an image's place in a prompt."""

    image_token_id: int
    image_seq_len: int
    """`<image>` positions per tile (connector output length: (size/patch)^2 / scale^2)."""
    tile_size: int
    """`max_image_size.longest_edge`: the vision encoder's square input."""
    longest_edge: int
    """`size.longest_edge`: every image is first resized so its longest side is this."""
    do_image_splitting: bool = True

    def __post_init__(self) -> None:
        for name in ("image_token_id", "image_seq_len", "tile_size", "longest_edge"):
            value = getattr(self, name)
            if type(value) is not int or value < (0 if name == "image_token_id" else 1):
                raise ValueError(f"ImagePromptSpec.{name}: got {value!r}")

    @classmethod
    def from_dir(cls, path: Path, config: Mapping[str, Any]) -> ImagePromptSpec:
        """From a Hugging Face Idefics3 / SmolVLM directory: `config` is its config.json,
        the processor settings come from preprocessor_config.json (and processor_config.json's
        `image_seq_len`, when there)."""
        settings: dict[str, Any] = {}
        for name in PROCESSOR_FILES:
            file = path / name
            if file.is_file():
                settings.update(json.loads(file.read_text()))
        vision = config.get("vision_config", {})
        scale = int(config.get("scale_factor", 2))
        patches = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))
        seq_len = int(settings.get("image_seq_len", patches * patches // (scale * scale)))
        tile = int(
            settings.get("max_image_size", {}).get("longest_edge", vision.get("image_size", 364))
        )
        longest = int(settings.get("size", {}).get("longest_edge", 4 * tile))
        return cls(
            image_token_id=int(config["image_token_id"]),
            image_seq_len=seq_len,
            tile_size=tile,
            longest_edge=longest,
            do_image_splitting=bool(settings.get("do_image_splitting", True)),
        )

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) the processor resizes an image to before tiling."""
        if not self.do_image_splitting:
            return self.tile_size, self.tile_size
        return whole_tiles(*longest_edge_size(width, height, self.longest_edge), self.tile_size)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of this size; (0, 0): the global image alone."""
        w, h = self.resized(width, height)
        t = self.tile_size
        if not self.do_image_splitting or (h <= t and w <= t):
            return 0, 0
        return (h - t) // t + 1, (w - t) // t + 1

    def tiles(self, width: int, height: int) -> int:
        """Frames the vision encoder sees: the grid's tiles, then the global image."""
        rows, cols = self.grid(width, height)
        return rows * cols + 1

    def expansion(self, rows: int, cols: int) -> str:
        """The text that replaces one `<image>` for an image of this grid."""
        run = IMAGE_TOKEN * self.image_seq_len
        global_image = f"{FAKE_TOKEN}{GLOBAL_TAG}{run}{FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return global_image
        text = "".join(
            "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{text}\n{global_image}"


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt, as far as its place in the prompt and the cache go."""

    content_hash: int
    """128 bits (worker.images.content_hash)."""
    width: int
    height: int


def expand_text(text: str, images: Sequence[PromptImage], spec: ImagePromptSpec) -> str:
    """A text prompt (or a rendered chat) with each `<image>` replaced by its image's expansion;
    the number of `<image>` must equal the number of images."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 != len(images):
        raise InvalidRequest(
            "images",
            f"the prompt has {len(parts) - 1} {IMAGE_TOKEN} placeholders for {len(images)} images",
        )
    out = [parts[0]]
    for image, part in zip(images, parts[1:], strict=True):
        out.append(spec.expansion(*spec.grid(image.width, image.height)))
        out.append(part)
    return "".join(out)


def expand_ids(
    ids: Sequence[int], images: Sequence[PromptImage], spec: ImagePromptSpec, encode: Any
) -> list[int]:
    """Token ids with one image token id per image: each replaced by its expansion's ids
    (`encode(text) -> ids`, without special tokens added)."""
    places = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(places) != len(images):
        raise InvalidRequest(
            "images",
            f"the prompt has {len(places)} image tokens ({spec.image_token_id}) for "
            f"{len(images)} images",
        )
    out: list[int] = []
    start = 0
    for place, image in zip(places, images, strict=True):
        out.extend(ids[start:place])
        out.extend(encode(spec.expansion(*spec.grid(image.width, image.height))))
        start = place + 1
    out.extend(ids[start:])
    return out


def tile_hash(image: PromptImage, tile: int) -> int:
    """128 bits naming one tile of one image: its run's `ImageToken.content_hash`."""
    raw = image.content_hash.to_bytes(16, "big") + tile.to_bytes(4, "big")
    return int.from_bytes(
        hashlib.blake2b(raw, digest_size=16, person=b"radixmesh-tile").digest(), "big"
    )


def image_runs(
    ids: Sequence[int], images: Sequence[PromptImage], spec: ImagePromptSpec
) -> list[tuple[int, int, int]]:
    """(start position, image index, tile index) of every run of image tokens in an expanded
    prompt, checked against the images: each run exactly `image_seq_len` long, each image's
    tiles in order, no image token left over. Raises InvalidRequest("images", ...)."""
    expected = [
        (i, t)
        for i, image in enumerate(images)
        for t in range(spec.tiles(image.width, image.height))
    ]
    runs: list[tuple[int, int, int]] = []
    n, token, length = len(ids), spec.image_token_id, spec.image_seq_len
    pos = 0
    while pos < n:
        if ids[pos] != token:
            pos += 1
            continue
        end = pos
        while end < n and ids[end] == token:
            end += 1
        if (end - pos) % length:
            raise InvalidRequest(
                "images",
                f"a run of {end - pos} image tokens at position {pos}; runs are {length} long",
            )
        for start in range(pos, end, length):
            if len(runs) >= len(expected):
                raise InvalidRequest(
                    "images", f"more image tokens than the {len(images)} images fill"
                )
            runs.append((start, *expected[len(runs)]))
        pos = end
    if len(runs) != len(expected):
        raise InvalidRequest(
            "images", f"the prompt holds {len(runs)} image tiles; its images have {len(expected)}"
        )
    return runs


def cache_tokens(
    ids: Sequence[int], images: Sequence[PromptImage], spec: ImagePromptSpec
) -> list[CacheToken]:
    """The prompt as cache tokens: text ids as they are, each tile's run one ImageToken."""
    if not images:
        return list(ids)
    out: list[CacheToken] = []
    pos = 0
    for start, image, tile in image_runs(ids, images, spec):
        out.extend(ids[pos:start])
        out.append(ImageToken(tile_hash(images[image], tile), spec.image_seq_len))
        pos = start + spec.image_seq_len
    out.extend(ids[pos:])
    return out


def longest_edge_size(width: int, height: int, longest_edge: int) -> tuple[int, int]:
    """The (width, height) transformers' Idefics3 processor resizes an image to first: its
    longest side to `longest_edge` (up or down), the other kept in proportion, at most 4096."""
    h, w = _rescale_to_max_len(height, width, longest_edge)
    h, w = _scale_below(h, w, MAX_IMAGE_SIDE)
    return w, h


def whole_tiles(width: int, height: int, tile: int) -> tuple[int, int]:
    """transformers' `resize_for_vision_encoder` size: both sides up to whole tiles."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return width, height


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_rescale_to_max_len` (min_len 1)."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_scale_below_upper_bound`."""
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)
