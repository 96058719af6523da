"""A vision-language checkpoint's eyes: an image in, the input embeddings of its image tokens out.

`Vision` bundles what the engine needs to put an image into a prompt: the prompt spec (how many
image-token positions an image of a given size fills, worker/image_prompt.py), the image
processor (Pillow + torch, worker/image_processor.py) and the vision tower (SigLIP encoder and
connector, worker/vision_model.py). `encode` returns one row per image-token position, in the
order the prompt lays them out (row-major tiles, then the global image; each tile's
`image_seq_len` tokens in the connector's order): the engine puts row k into the batch at the
image's k-th image-token position (ForwardBatch.embed_rows / embeds). It holds no cache and no
request state; encoding is pure, so equal images give equal rows.
"""

from __future__ import annotations

import torch

from worker.image_processor import ImageProcessor
from worker.image_prompt import ImagePromptSpec
from worker.images import CheckedImage
from worker.vision_model import VisionTower

FRAMES_PER_PASS = 8
"""Frames encoded in one forward pass of the tower (bounds the activations of a large image)."""


class Vision:
    def __init__(
        self,
        spec: ImagePromptSpec,
        processor: ImageProcessor,
        tower: VisionTower,
        frames_per_pass: int = FRAMES_PER_PASS,
    ) -> None:
        if spec.tile_size != tower.config.vision.image_size:
            raise ValueError(
                f"the processor's {spec.tile_size}-pixel tiles do not fit the encoder's "
                f"{tower.config.vision.image_size}-pixel input"
            )
        if spec.image_seq_len != tower.config.image_seq_len:
            raise ValueError(
                f"the prompt spec's {spec.image_seq_len} tokens a tile differ from the "
                f"connector's {tower.config.image_seq_len}"
            )
        if frames_per_pass < 1:
            raise ValueError(f"frames_per_pass must be >= 1, got {frames_per_pass}")
        self.spec = spec
        self.processor = processor
        self.tower = tower.eval()
        self.frames_per_pass = frames_per_pass

    @property
    def device(self) -> torch.device:
        return self.tower.connector.modality_projection.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tower.connector.modality_projection.proj.weight.dtype

    @property
    def hidden_size(self) -> int:
        """The text model's width: each row of `encode`."""
        return self.tower.config.text.hidden_size

    def num_tokens(self, image: CheckedImage) -> int:
        """Image-token positions the image fills in a prompt: rows of `encode(image)`."""
        return self.spec.tiles(image.width, image.height) * self.spec.image_seq_len

    def pixel_values(self, image: CheckedImage) -> torch.Tensor:
        """[tiles, 3, tile, tile] float32 on the CPU: what the encoder sees of `image`."""
        pixels = self.processor.pixel_values(image.rgb)
        expected = self.spec.tiles(image.width, image.height)
        if pixels.shape[0] != expected:  # the prompt's runs were laid out for `expected`
            raise RuntimeError(
                f"the image processor made {pixels.shape[0]} frames of a {image.width}x"
                f"{image.height} image; the prompt spec counts {expected}"
            )
        return pixels

    def encode(self, image: CheckedImage) -> torch.Tensor:
        """[tiles * spec.image_seq_len, text hidden] in the model's dtype and device: the
        connector output of each frame in order (row-major tiles, then the global image),
        flattened, so row k is the input embedding of the image's k-th image-token position."""
        return self.encode_pixels(self.pixel_values(image))

    @torch.inference_mode()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """`encode` from `pixel_values`' frames [N, 3, tile, tile]."""
        pixels = pixels.to(self.device, self.dtype)
        parts = [
            self.tower(pixels[i : i + self.frames_per_pass])
            for i in range(0, pixels.shape[0], self.frames_per_pass)
        ]
        return torch.cat(parts).reshape(-1, self.hidden_size)
