"""cluster/http/image_parts.py and the chat conversions around it: OpenAI image_url data URLs and
Anthropic base64 image blocks become the files' bytes, placed by chat parts, and everything the
server must not or cannot take is refused with a 400 naming the part."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
from PIL import Image

from cluster.http import anthropic_routes, openai_params
from cluster.http.anthropic_schema import MessagesRequest
from cluster.http.errors import HttpError
from cluster.http.image_parts import (
    PART_BYTES,
    anthropic_image,
    data_url_bytes,
    image_body_bytes,
    openai_image,
    signature_format,
)
from cluster.http.openai_schema import ChatCompletionRequest
from cluster.model_vision import ModelVision
from tests.worker.vlm_fixtures import png_bytes
from worker.image_prompt import ImagePromptSpec
from worker.images import ImageLimits


def encoded(fmt: str, size: tuple[int, int] = (6, 4)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize(
    ("fmt", "media"), [("PNG", "png"), ("JPEG", "jpeg"), ("JPEG", "jpg"), ("WEBP", "webp")]
)
def test_data_urls_of_each_format_decode_to_the_file(fmt: str, media: str) -> None:
    data = encoded(fmt)
    assert signature_format(data) == fmt
    assert data_url_bytes(data_url(data, f"image/{media}"), "p") == data
    part = {
        "type": "image_url",
        "image_url": {"url": data_url(data, f"image/{media}"), "detail": "low"},
    }
    assert openai_image(part, "messages[0].content[0]") == data


def refusal(call: Any, *args: Any) -> HttpError:
    with pytest.raises(HttpError) as err:
        call(*args)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://example.com/cat.png", "fetches nothing; send a data URL"),
        ("http://127.0.0.1:8000/v1/models", "fetches nothing"),
        ("file:///etc/passwd", "fetches nothing"),
        ("cat.png", "expected a data URL"),
        ("data:image/png,iVBORw0KGgo=", "must be base64"),
        ("data:image/png;base64", "without its ','"),
        ("data:image/gif;base64,R0lGODlh", "media type 'image/gif'"),
        ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain'"),
        ("data:image/png;base64,not base64!!", "does not decode"),
        (data_url(encoded("JPEG"), "image/png"), "declared image/png, but the data is a JPEG"),
        (data_url(encoded("PNG"), "image/webp"), "is a PNG file"),
        (data_url(encoded("PNG"), "image/jpg"), "declared image/jpg, but the data is a PNG"),
    ],
)
def test_openai_image_urls_that_cannot_be_served_name_the_part(url: str, why: str) -> None:
    part = {"type": "image_url", "image_url": {"url": url}}
    err = refusal(openai_image, part, "messages[2].content[1]")
    assert err.param == "messages[2].content[1].image_url"
    assert why in err.message and err.message.startswith("messages[2].content[1].image_url: ")


def test_openai_image_url_shapes() -> None:
    data = encoded("PNG")
    assert openai_image({"type": "image_url", "image_url": data_url(data)}, "m") == data
    for bad in (
        {"type": "image_url"},
        {"type": "image_url", "image_url": {"uri": data_url(data)}},
        {"type": "image_url", "image_url": {"url": data_url(data)}, "extra": 1},
    ):
        assert refusal(openai_image, bad, "m").param == "m.image_url"


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ({"type": "url", "url": "https://example.com/a.png"}, "fetches nothing"),
        ({"type": "file", "file_id": "file_1"}, "fetches nothing"),
        ({"type": "base64", "media_type": "image/gif", "data": "R0lGODlh"}, "image/gif"),
        ({"type": "base64", "media_type": "image/png", "data": "%%%"}, "does not decode"),
        (
            {
                "type": "base64",
                "media_type": "image/jpeg",
                "data": base64.b64encode(encoded("PNG")).decode(),
            },
            "declared image/jpeg, but the data is a PNG",
        ),
        ({"type": "base64", "media_type": "image/png"}, "must be strings"),
        ("not a mapping", "expected"),
    ],
)
def test_anthropic_image_sources_that_cannot_be_served_name_the_block(
    source: Any, why: str
) -> None:
    err = refusal(anthropic_image, {"type": "image", "source": source}, "messages[0].content[1]")
    assert err.param == "messages[0].content[1].source" and why in err.message


def test_anthropic_base64_block_decodes_to_the_file() -> None:
    data = encoded("WEBP")
    source = {"type": "base64", "media_type": "image/webp", "data": base64.b64encode(data).decode()}
    assert anthropic_image({"type": "image", "source": source}, "m") == data


def test_openai_chat_parts_become_chat_parts_and_images_in_order() -> None:
    a, b = png_bytes(8, 8, 1), png_bytes(8, 8, 2)
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(a)}},
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": data_url(b), "detail": "high"}},
                ],
            },
        ],
    )
    message, fields = openai_params.chat_request(body, "rid", "")
    assert list(message.images) == [a, b]
    assert fields == ["messages[1].content[0].image_url", "messages[1].content[2].image_url"]
    system, user = message.chat.messages
    assert system.content == "be brief" and not system.parts  # text only: as before
    assert [p.WhichOneof("part") for p in user.parts] == ["image", "text", "image"]
    assert [user.parts[0].image, user.parts[1].text, user.parts[2].image] == [0, "and", 1]


def test_openai_text_only_parts_are_joined_as_before_and_other_parts_refused() -> None:
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
    )
    message, fields = openai_params.chat_request(body, "rid", "")
    assert message.chat.messages[0].content == "a\nb" and fields == [] and not message.images
    audio = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
    )
    err = refusal(openai_params.chat_request, audio, "rid", "")
    assert err.param == "messages[0].content[0]" and "input_audio" in err.message


def test_tokenize_takes_image_parts_and_refuses_a_bad_one_by_name() -> None:
    """/tokenize reads chat messages as a request does (openai_params.chat_prompt): an image
    part's file joins the prompt's images, named by its part; a bad data URL is a 400 naming
    the part. (The count itself: tests/cluster/test_vision_serving.py.)"""
    png = encoded("PNG")
    image = {"type": "image_url", "image_url": {"url": data_url(png)}}
    text = {"type": "text", "text": "What is it?"}
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [text, image]}])
    chat = openai_params.chat_prompt(body.messages)
    assert chat.images == [png] and chat.image_fields == ["messages[0].content[1].image_url"]
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
    broken = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [bad]}])
    err = refusal(openai_params.chat_prompt, broken.messages)
    assert err.param == "messages[0].content[0].image_url"


def test_anthropic_image_blocks_become_chat_parts() -> None:
    data = png_bytes(8, 8, 3)
    block = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(data).decode(),
        },
    }
    body = MessagesRequest(
        model="m",
        max_tokens=4,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "What is it?"}]}],
    )
    message, fields = anthropic_routes.generate_request(body, "rid", "")
    assert list(message.images) == [data] and fields == ["messages[0].content[0].source"]
    parts = message.chat.messages[0].parts
    assert [parts[0].image, parts[1].text] == [0, "What is it?"]
    in_system = MessagesRequest(
        model="m", max_tokens=4, system=[block], messages=[{"role": "user", "content": "hi"}]
    )
    assert refusal(anthropic_routes.generate_request, in_system, "rid", "").param == "system"


def test_the_body_allows_max_images_base64_images_for_a_vision_model_only() -> None:
    spec = ImagePromptSpec(image_token_id=5, image_seq_len=4, tile_size=32, longest_edge=64)
    vision = ModelVision(spec, ImageLimits(max_images=3, max_pixels=100, max_bytes=3000))
    assert image_body_bytes(None) == 0
    assert image_body_bytes(vision) == 3 * (4000 + PART_BYTES)
    one = data_url(b"\x89PNG\r\n\x1a\n" + bytes(3000 - 8))
    part = {"type": "image_url", "image_url": {"url": one, "detail": "auto"}}
    assert 3 * len(json.dumps(part)) <= image_body_bytes(vision)
