"""worker.image_processor against transformers' Idefics3ImageProcessorPil on the same settings.

Pixel values must be equal (the same Pillow resizes in the same order, the same float64 rescale
and float32 normalisation), and the frame count must be what ImagePromptSpec counts, since the
prompt's image-token runs are laid out from the spec alone.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.worker.vlm_fixtures import png_bytes, preprocessor_config
from worker.image_processor import ImageProcessor, ImageProcessorConfig
from worker.image_prompt import ImagePromptSpec

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = [(20, 20), (32, 32), (33, 10), (50, 37), (37, 50), (64, 64), (100, 30), (5, 90), (1, 1)]
"""(width, height): one tile, exactly one tile, wide and tall grids, upscaled, a sliver."""


def _image(width: int, height: int, seed: int) -> Image.Image:
    return Image.open(io.BytesIO(png_bytes(width, height, seed))).convert("RGB")


def _theirs(settings: dict[str, object], image: Image.Image) -> torch.Tensor:
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    kwargs = {
        k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")
    }
    processor = Idefics3ImageProcessorPil(**kwargs)
    out = processor(images=[[image]], return_tensors="pt")
    return out["pixel_values"][0]


def _spec(settings: dict[str, object]) -> ImagePromptSpec:
    config = ImageProcessorConfig.from_dict(settings)
    return ImagePromptSpec(0, 4, config.tile_size, config.longest_edge, config.do_image_splitting)


@pytest.mark.parametrize("split", [True, False], ids=["split", "no-split"])
@pytest.mark.parametrize(("width", "height"), SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_pixel_values_equal_transformers(width: int, height: int, split: bool) -> None:
    settings = preprocessor_config(tile=32, longest_edge=64, do_image_splitting=split)
    image = _image(width, height, seed=width * 1000 + height)
    ours = ImageProcessor(ImageProcessorConfig.from_dict(settings)).pixel_values(image)
    theirs = _theirs(settings, image)
    assert ours.dtype == torch.float32
    assert ours.shape == theirs.shape
    assert ours.shape[0] == _spec(settings).tiles(width, height)
    assert torch.equal(ours, theirs)


def test_smolvlm_settings_and_other_normalisation() -> None:
    """SmolVLM-256M's 512-pixel tiles and 2048 longest edge (a 3 x 2 grid), and a config with
    ImageNet statistics and bicubic resampling, so nothing depends on mean = std = 0.5."""
    smol = preprocessor_config(tile=512, longest_edge=2048, do_image_splitting=True)
    imagenet = {
        **preprocessor_config(tile=32, longest_edge=96, do_image_splitting=True),
        "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225],
        "resample": 3,
    }
    for settings, (width, height) in ((smol, (300, 200)), (imagenet, (70, 41))):
        image = _image(width, height, seed=7)
        ours = ImageProcessor(ImageProcessorConfig.from_dict(settings)).pixel_values(image)
        theirs = _theirs(settings, image)
        assert ours.shape[0] == _spec(settings).tiles(width, height) > 1
        assert torch.equal(ours, theirs)


def test_frames_are_row_major_tiles_then_the_global_image() -> None:
    processor = ImageProcessor(ImageProcessorConfig(tile_size=32, longest_edge=64))
    image = _image(64, 40, seed=3)  # resized 64 x 40 -> 64 x 64: 2 x 2 tiles
    frames = processor.frames(image)
    assert [f.size for f in frames] == [(32, 32)] * 5
    whole = image.resize((64, 40), Image.Resampling.LANCZOS).resize(
        (64, 64), Image.Resampling.LANCZOS
    )
    for index, (row, col) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        box = (col * 32, row * 32, col * 32 + 32, row * 32 + 32)
        assert frames[index].tobytes() == whole.crop(box).tobytes()
    assert frames[4].tobytes() == whole.resize((32, 32), Image.Resampling.LANCZOS).tobytes()


def test_config_from_dir_reads_the_fixture_settings(tmp_path: Path) -> None:
    import json

    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(tile=48, longest_edge=96, do_image_splitting=False))
    )
    config = ImageProcessorConfig.from_dir(tmp_path)
    assert (config.tile_size, config.longest_edge, config.do_image_splitting) == (48, 96, False)
    assert config.resample == 1 and config.image_mean == (0.5, 0.5, 0.5)
    with pytest.raises(FileNotFoundError, match=r"preprocessor_config\.json"):
        ImageProcessorConfig.from_dir(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="resample 9"):
        ImageProcessorConfig(resample=9)
