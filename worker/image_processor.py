"""An image into the vision encoder's frames, as an Idefics3 / SmolVLM preprocessor_config says.

The same steps, in the same order and with the same rounding, as transformers'
Idefics3ImageProcessorPil, so that pixel values are equal to its (tests check):

    RGB uint8 image (W x H)
      -> resize (LANCZOS) so the longest edge is `size.longest_edge` (the other side: int of
         the aspect ratio, rounded up to even; nothing above 4096)
      -> resize again to whole tiles: each side rounded up to a multiple of the tile
      -> cut into tile x tile crops, row-major, then the whole image resized to one tile (the
         global image) -- or, when it fits in one tile, the image alone
      -> [frames, 3, tile, tile] float32: x * rescale_factor (in float64, as numpy does), then
         (x - mean) / std per channel

Every resize works on 8-bit pixels through Pillow, each from the previous step's image, as
transformers does. Without `do_image_splitting` the resized image becomes one tile. The frame
count always equals `ImagePromptSpec.tiles(W, H)` (checked), since the prompt's runs of image
tokens were laid out from that. Imports torch and Pillow; no model, no network.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from worker.image_prompt import longest_edge_size, whole_tiles

PREPROCESSOR_FILE = "preprocessor_config.json"
RESAMPLE = {
    0: Image.Resampling.NEAREST,
    1: Image.Resampling.LANCZOS,
    2: Image.Resampling.BILINEAR,
    3: Image.Resampling.BICUBIC,
    4: Image.Resampling.BOX,
    5: Image.Resampling.HAMMING,
}
"""preprocessor_config.json's `resample` (PIL's enum values; SmolVLM's is 1, LANCZOS)."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json of an Idefics3 checkpoint (transformers' defaults where absent)."""

    tile_size: int = 364
    """`max_image_size.longest_edge`."""
    longest_edge: int = 4 * 364
    """`size.longest_edge`."""
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: int = 1

    def __post_init__(self) -> None:
        if self.tile_size < 1 or self.longest_edge < 1:
            raise ValueError(
                f"tile size {self.tile_size} and longest edge {self.longest_edge} must be >= 1"
            )
        if self.resample not in RESAMPLE:
            raise ValueError(f"resample {self.resample} is not one of {sorted(RESAMPLE)}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0 in self.image_std:
            raise ValueError(f"image_mean {self.image_mean} / image_std {self.image_std}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        defaults = cls()
        return cls(
            tile_size=int(raw.get("max_image_size", {}).get("longest_edge", defaults.tile_size)),
            longest_edge=int(raw.get("size", {}).get("longest_edge", defaults.longest_edge)),
            do_resize=bool(raw.get("do_resize", True)),
            do_image_splitting=bool(raw.get("do_image_splitting", True)),
            do_rescale=bool(raw.get("do_rescale", True)),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            do_normalize=bool(raw.get("do_normalize", True)),
            image_mean=_triple(raw.get("image_mean", defaults.image_mean)),
            image_std=_triple(raw.get("image_std", defaults.image_std)),
            resample=int(raw.get("resample", 1)),
        )

    @classmethod
    def from_dir(cls, path: Path) -> ImageProcessorConfig:
        file = Path(path) / PREPROCESSOR_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: a vision checkpoint needs it")
        return cls.from_dict(json.loads(file.read_text()))


def _triple(value: float | Sequence[float]) -> tuple[float, float, float]:
    if isinstance(value, int | float):
        return (float(value),) * 3
    a, b, c = (float(v) for v in value)
    return a, b, c


class ImageProcessor:
    """Pillow + torch: one RGB image -> its frames' pixel values."""

    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config
        self._resample = RESAMPLE[config.resample]
        self._mean = torch.tensor(config.image_mean, dtype=torch.float32).view(3, 1, 1)
        self._std = torch.tensor(config.image_std, dtype=torch.float32).view(3, 1, 1)

    def frames(self, image: Image.Image) -> list[Image.Image]:
        """The encoder's frames as 8-bit RGB tiles: row-major crops then the global image, or
        the one tile an image that fits in it becomes."""
        c, t = self.config, self.config.tile_size
        image = image.convert("RGB")
        if c.do_resize:
            image = self._resize(
                image, *longest_edge_size(image.width, image.height, c.longest_edge)
            )
        if not c.do_image_splitting:
            return [self._resize(image, t, t)]
        w, h = whole_tiles(image.width, image.height, t)
        image = self._resize(image, w, h)
        if h <= t and w <= t:
            return [image]
        crops = [
            image.crop((col * t, row * t, (col + 1) * t, (row + 1) * t))
            for row in range(h // t)
            for col in range(w // t)
        ]
        return [*crops, self._resize(image, t, t)]

    def pixel_values(self, image: Image.Image) -> torch.Tensor:
        """[frames, 3, tile, tile] float32, rescaled and normalised as configured."""
        arrays = np.stack([np.asarray(frame, dtype=np.uint8) for frame in self.frames(image)])
        pixels = torch.from_numpy(arrays).permute(0, 3, 1, 2)  # NHWC -> NCHW
        if self.config.do_rescale:  # numpy: float64 product, then down to float32
            pixels = (pixels.to(torch.float64) * self.config.rescale_factor).to(torch.float32)
        else:
            pixels = pixels.to(torch.float32)
        if self.config.do_normalize:
            pixels = (pixels - self._mean) / self._std
        return pixels.contiguous()

    def _resize(self, image: Image.Image, width: int, height: int) -> Image.Image:
        return image.resize((width, height), resample=self._resample)
