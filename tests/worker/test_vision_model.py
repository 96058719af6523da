"""The Idefics3 / SmolVLM family against transformers on the same tiny checkpoint.

transformers writes the checkpoint (tests/worker/vlm_fixtures.py) and is the oracle: its
processor lays out the prompt, its Idefics3ForConditionalGeneration computes the logits. Ours
loads the directory with `load_model`, encodes the images with `Vision.encode`, and runs the text
model through the paged-KV ModelRunner with the image rows' embeddings in
ForwardBatch.embed_rows / embeds: in one chunk, and in two chunks cut inside an image run.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.helpers import relative_error
from tests.worker.vlm_fixtures import build_tiny_vlm, png_bytes
from worker.image_prompt import PromptImage, expand_text, image_runs
from worker.images import CheckedImage, ImageLimits, check_image
from worker.loader import LoadedModel, load_model
from worker.model_runner import Chunk, ModelRunner

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAGE = 16
IMAGES = [(50, 37), (100, 30)]
"""A 2 x 2 grid plus the global image (5 frames), and a 1 x 2 grid plus the global (3 frames)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny", seed=3)


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> LoadedModel:
    return load_model(checkpoint)


@pytest.fixture(scope="module")
def theirs(checkpoint: Path) -> Any:
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(
        checkpoint, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Any:
    return transformers.AutoProcessor.from_pretrained(checkpoint)


def _images(sizes: Sequence[tuple[int, int]]) -> list[CheckedImage]:
    return [
        check_image(png_bytes(w, h, seed=i), f"images[{i}]", ImageLimits())
        for i, (w, h) in enumerate(sizes)
    ]


def _messages(count: int) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare"}]
    for _ in range(count):
        parts += [{"type": "image"}, {"type": "text", "text": " and"}]
    return [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": "Two noisy squares."}]},
        {"role": "user", "content": [{"type": "text", "text": "Which is larger?"}]},
    ]


def _prompt(processor: Any, images: list[CheckedImage]) -> tuple[str, dict[str, torch.Tensor]]:
    text = processor.apply_chat_template(_messages(len(images)), add_generation_prompt=True)
    inputs = processor(text=text, images=[i.rgb for i in images], return_tensors="pt")
    return text, inputs


def _run(
    ours: LoadedModel,
    ids: list[int],
    embeds: torch.Tensor,
    cuts: Sequence[int] = (),
    all_logits: bool = False,
) -> torch.Tensor:
    """Our logits for `ids` computed in chunks ending at `cuts` (then the rest), the image rows'
    embeddings given per chunk: the last position's, or every position of the last chunk."""
    assert ours.vision is not None
    pages = list(range(1, len(ids) // PAGE + 2))
    runner = ModelRunner(ours.model, num_pages=len(pages) + 1, page_size=PAGE)
    image_rows = torch.tensor(
        [i for i, t in enumerate(ids) if t == ours.vision.spec.image_token_id]
    )
    assert len(image_rows) == len(embeds)
    bounds = [0, *cuts, len(ids)]
    logits = torch.empty(0)
    for start, end in itertools.pairwise(bounds):
        batch = runner.build_batch([Chunk(ids[start:end], start, pages, True)])
        inside = (image_rows >= start) & (image_rows < end)
        if inside.any():
            batch.embed_rows = image_rows[inside] - start
            batch.embeds = embeds[inside]
        if all_logits:
            batch.logits_indices = torch.arange(end - start)
        logits = ours.model(batch, runner.kv)
    return logits


def test_processor_expansion_equals_ours(ours: LoadedModel, processor: Any) -> None:
    """transformers' Idefics3Processor and worker.image_prompt lay the prompt out alike: the same
    chat rendering, the same expanded ids, runs that image_runs accepts."""
    assert ours.vision is not None and ours.tokenizer is not None
    spec = ours.vision.spec
    assert (spec.image_token_id, spec.image_seq_len) == (
        processor.image_token_id,
        processor.image_seq_len,
    )
    images = _images(IMAGES)
    text, inputs = _prompt(processor, images)
    assert ours.tokenizer.apply_chat_template(_messages(len(images))) == text
    prompt_images = [PromptImage(i.content_hash, i.width, i.height) for i in images]
    expanded = expand_text(text, prompt_images, spec)
    ids = ours.tokenizer.encode(expanded, add_special_tokens=False)
    assert ids == inputs["input_ids"][0].tolist()
    runs = image_runs(ids, prompt_images, spec)
    tiles = [(image, tile) for _, image, tile in runs]
    assert tiles == [(0, t) for t in range(5)] + [(1, t) for t in range(3)]


def test_pixel_values_and_encodings_equal_transformers(
    ours: LoadedModel, theirs: Any, processor: Any
) -> None:
    assert ours.vision is not None
    images = _images(IMAGES)
    _, inputs = _prompt(processor, images)
    ours_pixels = torch.cat([ours.vision.pixel_values(i) for i in images])
    frames = len(ours_pixels)
    assert frames == 8
    assert torch.equal(ours_pixels, inputs["pixel_values"][0, :frames])
    with torch.no_grad():
        features = theirs.model.get_image_features(
            inputs["pixel_values"], inputs["pixel_attention_mask"]
        ).pooler_output
    expected = torch.cat(list(features))
    got = torch.cat([ours.vision.encode(i) for i in images])
    assert got.shape == (frames * 4, 64) == expected.shape
    assert got.dtype == torch.float32
    assert relative_error(got, expected) < 1e-5
    assert ours.vision.num_tokens(images[0]) == 5 * 4


@pytest.mark.parametrize("count", [1, 2], ids=["one-image", "two-images"])
def test_logits_match_transformers(
    ours: LoadedModel, theirs: Any, processor: Any, count: int
) -> None:
    assert ours.vision is not None
    images = _images(IMAGES[:count])
    _, inputs = _prompt(processor, images)
    with torch.no_grad():
        expected = theirs(**inputs).logits[0].float()
    ids = inputs["input_ids"][0].tolist()
    embeds = torch.cat([ours.vision.encode(i) for i in images])
    got = _run(ours, ids, embeds, all_logits=True)
    assert got.shape == expected.shape
    assert relative_error(got, expected) < 1e-5
    # The image rows matter: zero embeddings there change the answer.
    assert relative_error(_run(ours, ids, torch.zeros_like(embeds))[-1], expected[-1]) > 1e-2


def test_chunked_prompt_gives_the_same_logits(
    ours: LoadedModel, theirs: Any, processor: Any
) -> None:
    """A prefix first (cut inside an image's run, then at a run's end), then the rest."""
    assert ours.vision is not None
    images = _images(IMAGES)
    _, inputs = _prompt(processor, images)
    ids = inputs["input_ids"][0].tolist()
    embeds = torch.cat([ours.vision.encode(i) for i in images])
    with torch.no_grad():
        expected = theirs(**inputs).logits[0, -1].float()
    whole = _run(ours, ids, embeds)[-1]
    first_run = ids.index(ours.vision.spec.image_token_id)
    for cuts in ([first_run + 2], [first_run + 4], [first_run + 1, len(ids) - 3]):
        got = _run(ours, ids, embeds, cuts)[-1]
        assert relative_error(got, whole) < 1e-5
        assert relative_error(got, expected) < 1e-5


def test_tied_head_single_frame_and_bfloat16(tmp_path: Path) -> None:
    """A checkpoint whose head is its embedding (no lm_head.weight saved) and whose images are
    one frame each (longest edge = tile: the global image alone) matches transformers; loading
    in bfloat16 puts the vision tower and its outputs in bfloat16 too."""
    path = build_tiny_vlm(tmp_path / "tied", seed=5, longest_edge=32, tie_word_embeddings=True)
    loaded = load_model(path)
    assert loaded.vision is not None and loaded.model.lm_head is None
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    images = _images(IMAGES[:1])
    assert loaded.vision.spec.grid(images[0].width, images[0].height) == (0, 0)
    _, inputs = _prompt(transformers.AutoProcessor.from_pretrained(path), images)
    with torch.no_grad():
        expected = model.eval()(**inputs).logits[0, -1].float()
    embeds = loaded.vision.encode(images[0])
    assert embeds.shape == (4, 64)
    got = _run(loaded, inputs["input_ids"][0].tolist(), embeds)[-1]
    assert relative_error(got, expected) < 1e-5

    half = load_model(path, dtype=torch.bfloat16)
    assert half.vision is not None
    encoded = half.vision.encode(images[0])
    assert encoded.dtype == torch.bfloat16 and half.vision.dtype == torch.bfloat16
    assert relative_error(encoded.float(), embeds) < 5e-2
