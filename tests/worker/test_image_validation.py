"""worker/validation.py with images, on the tiny Idefics3 checkpoint's tokenizer and placement:
a text prompt's <image>, a chat's image parts and token ids with one image token per image all
give the same expanded ids; expanded ids are kept as they are; every mismatch is refused naming
what was wrong; image positions count against the context like any token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.worker.vlm_fixtures import build_tiny_vlm, png_bytes
from worker.errors import InvalidRequest
from worker.image_prompt import ImagePromptSpec, image_runs
from worker.images import ImageLimits
from worker.request import GenerateRequest, Resume
from worker.sampling_params import SamplingParams
from worker.tokenizer import Tokenizer
from worker.validation import (
    RequestLimits,
    prompt_ids,
    prompt_images,
    request_images,
    validate,
)

IMAGES = (png_bytes(60, 40, seed=1), png_bytes(100, 30, seed=2))
"""5 runs (a 2 x 2 grid and the global image), then 3 (a 1 x 2 grid and the global image)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny", seed=2)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def limits(checkpoint: Path) -> RequestLimits:
    spec = ImagePromptSpec.from_dir(
        checkpoint, json.loads((checkpoint / "config.json").read_text())
    )
    return RequestLimits(vocab_size=552, max_model_len=512, image_spec=spec)


def chat(*parts: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    return ({"role": "user", "content": list(parts)},)


IMAGE = {"type": "image"}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def test_text_chat_and_ids_prompts_expand_their_images_alike(
    tokenizer: Tokenizer, limits: RequestLimits
) -> None:
    assert limits.image_spec is not None
    image_id = limits.image_spec.image_token_id
    from_chat = prompt_ids(
        GenerateRequest(
            "c", messages=chat(text("Compare "), IMAGE, text(" with "), IMAGE), images=IMAGES
        ),
        tokenizer,
        limits,
    )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [text("Compare "), IMAGE, text(" with "), IMAGE]}]
    )
    assert rendered.count("<image>") == 2
    from_text = prompt_ids(GenerateRequest("t", prompt=rendered, images=IMAGES), tokenizer, limits)
    assert from_text == from_chat  # (this tokenizer adds no BOS)
    placed = prompt_images(request_images(GenerateRequest("x", images=IMAGES), limits))
    runs = image_runs(from_chat, placed, limits.image_spec)
    assert [(image, tile) for _, image, tile in runs] == [(0, t) for t in range(5)] + [
        (1, t) for t in range(3)
    ]
    assert from_chat.count(image_id) == 8 * limits.image_spec.image_seq_len
    # token ids: one image token per image, expanded the same way
    unexpanded = tokenizer.encode(rendered, add_special_tokens=False)
    assert unexpanded.count(image_id) == 2
    from_ids = prompt_ids(
        GenerateRequest("i", prompt_token_ids=tuple(unexpanded), images=IMAGES), tokenizer, limits
    )
    assert from_ids == from_chat
    # already expanded (what the router forwards): kept, even without a tokenizer
    kept = prompt_ids(
        GenerateRequest("e", prompt_token_ids=tuple(from_chat), images=IMAGES), None, limits
    )
    assert kept == from_chat


def test_a_text_content_still_works_for_a_vision_model(
    tokenizer: Tokenizer, limits: RequestLimits
) -> None:
    plain = ({"role": "user", "content": "Hello there"},)
    parts = chat(text("Hello there"))
    ids = prompt_ids(GenerateRequest("p", messages=plain), tokenizer, limits)
    assert ids == prompt_ids(GenerateRequest("q", messages=parts), tokenizer, limits)
    assert "Hello there" in tokenizer.decode(ids)


def test_a_text_model_reads_text_parts_as_their_text(tokenizer: Tokenizer) -> None:
    text_limits = RequestLimits(vocab_size=552, max_model_len=512)
    parts = chat(text("Hello "), text("there"))
    plain = ({"role": "user", "content": "Hello there"},)
    assert prompt_ids(GenerateRequest("a", messages=parts), tokenizer, text_limits) == prompt_ids(
        GenerateRequest("b", messages=plain), tokenizer, text_limits
    )
    literal = prompt_ids(GenerateRequest("c", prompt="an <image> tag"), tokenizer, text_limits)
    assert literal == tokenizer.encode("an <image> tag")  # text, nothing to expand


@pytest.mark.parametrize(
    ("request_", "field", "why"),
    [
        (GenerateRequest("a", prompt="look: <image>"), "images", "1 <image> placeholders for 0"),
        (
            GenerateRequest("b", prompt="<image> and <image>", images=IMAGES[:1]),
            "images",
            "2 <image> placeholders for 1",
        ),
        (
            GenerateRequest("c", messages=chat(IMAGE, text("hi")), images=IMAGES),
            "images",
            "1 image parts for 2 images",
        ),
        (
            GenerateRequest("d", messages=chat(text("see <image>")), images=IMAGES[:1]),
            "messages[0].content[0]",
            "a text part holds <image>",
        ),
        (
            GenerateRequest("e", messages=chat({"type": "video"})),
            "messages[0].content[0]",
            "expected",
        ),
        (
            GenerateRequest("f", prompt_token_ids=(5, 6, 513, 513, 7), images=IMAGES[:1]),
            "images",
            "image tokens",
        ),
        (GenerateRequest("g", prompt_token_ids=(5, 513, 513, 513, 513)), "images", "0 images"),
        (GenerateRequest("h", prompt="hi", images=(b"GIF89a....",)), "images[0]", "not an image"),
        (
            GenerateRequest("i", prompt="<image> def f(", images=IMAGES[:1], suffix=")"),
            "suffix",
            "a prompt without images",
        ),
    ],
)
def test_mismatches_are_refused_naming_the_part(
    tokenizer: Tokenizer,
    limits: RequestLimits,
    request_: GenerateRequest,
    field: str,
    why: str,
) -> None:
    with pytest.raises(InvalidRequest, match=why) as err:
        prompt_ids(request_, tokenizer, limits)
    assert err.value.field == field


def test_a_text_model_refuses_images_naming_them(tokenizer: Tokenizer) -> None:
    text_limits = RequestLimits(vocab_size=552, max_model_len=512)
    with pytest.raises(InvalidRequest, match="no vision encoder") as err:
        prompt_ids(
            GenerateRequest("a", prompt="<image>", images=IMAGES[:1]), tokenizer, text_limits
        )
    assert err.value.field == "images"
    with pytest.raises(InvalidRequest, match="no vision encoder") as err:
        prompt_ids(GenerateRequest("b", messages=chat(IMAGE)), tokenizer, text_limits)
    assert err.value.field == "messages[0].content[0]"


def test_the_operators_image_limits_apply(tokenizer: Tokenizer, limits: RequestLimits) -> None:
    tight = RequestLimits(
        vocab_size=552,
        max_model_len=512,
        image_spec=limits.image_spec,
        images=ImageLimits(max_images=1, max_pixels=1000),
    )
    with pytest.raises(InvalidRequest, match="2 images; at most 1") as err:
        prompt_ids(GenerateRequest("a", prompt="<image><image>", images=IMAGES), tokenizer, tight)
    assert err.value.field == "images"
    with pytest.raises(InvalidRequest, match="60x40 = 2400 pixels") as err:
        prompt_ids(GenerateRequest("b", prompt="<image>", images=IMAGES[:1]), tokenizer, tight)
    assert err.value.field == "images[0]"


def test_image_positions_count_against_the_context(
    tokenizer: Tokenizer, limits: RequestLimits
) -> None:
    request = GenerateRequest(
        "a", prompt="Describe <image>", images=IMAGES[:1], sampling=SamplingParams(max_tokens=4)
    )
    ids = prompt_ids(request, tokenizer, limits)
    text_only = len(tokenizer.encode("Describe "))
    assert len(ids) > text_only + 20  # 5 runs of 4 and their wrappers
    fits = RequestLimits(552, len(ids) + 4, image_spec=limits.image_spec)
    validate(request, ids, fits)
    short = RequestLimits(552, len(ids), image_spec=limits.image_spec)
    with pytest.raises(
        InvalidRequest, match=f"the prompt is {len(ids)} tokens, which leave no room"
    ):
        validate(request, ids, short)


def test_a_resumed_sample_may_have_generated_an_image_token(
    tokenizer: Tokenizer, limits: RequestLimits
) -> None:
    ids = prompt_ids(GenerateRequest("a", prompt="<image>", images=IMAGES[:1]), tokenizer, limits)
    assert limits.image_spec is not None
    generated = (limits.image_spec.image_token_id, 7)
    resumed = GenerateRequest(
        "a",
        prompt_token_ids=(*ids, *generated),
        images=IMAGES[:1],
        resume=Resume(sample_index=0, generated=2),
    )
    assert prompt_ids(resumed, tokenizer, limits) == [*ids, *generated]
