"""cluster/requests.py `prepare` with images, without a cluster: a hand-built ImagePromptSpec and
the tiny VLM's tokenizer (SmolVLM's chat template and image tokens), real PNG / JPEG files.

What the router must get right before any worker sees a request: images accepted only for a
vision model, each checked and refused by the name the client gave its part, chat parts placed
in order, the prompt expanded exactly as the worker expands it, and the routing keys carrying
the image's identity, so a re-sent image hashes to the same blocks and another image does not.
"""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from cache import DEFAULT_NAMESPACE, BlockHasher, IdentityScheme
from cache.tokens import has_typed_keys
from cluster.requests import PreparedRequest, prepare
from protos.radixmesh.v1 import serving_pb2
from tests.worker.vlm_fixtures import SMOLVLM_CHAT_TEMPLATE, png_bytes, vlm_tokenizer_json
from worker import validation
from worker.errors import InvalidRequest
from worker.image_prompt import ImagePromptSpec, PromptImage, image_runs
from worker.images import ImageLimits, content_hash
from worker.request import GenerateRequest
from worker.tokenizer import Tokenizer
from worker.validation import RequestLimits

SPEC = ImagePromptSpec(
    image_token_id=513, image_seq_len=4, tile_size=32, longest_edge=64, do_image_splitting=True
)
IMAGES = ImageLimits(max_images=3, max_pixels=200 * 200, max_bytes=1 << 20)
VISION = RequestLimits(600, 2048, image_spec=SPEC, images=IMAGES)
TEXT_MODEL = RequestLimits(600, 2048)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<end_of_utterance>",
        "chat_template": SMOLVLM_CHAT_TEMPLATE,
    }
    return Tokenizer.from_files(
        {"tokenizer.json": vlm_tokenizer_json(), "tokenizer_config.json": json.dumps(config)}
    )


def chat(
    *messages: tuple[str, list[str | int]], images: list[bytes]
) -> serving_pb2.GenerateRequest:
    """A chat whose messages are parts: a str is text, an int places that image."""
    request = serving_pb2.GenerateRequest(images=images)
    for role, parts in messages:
        message = request.chat.messages.add(role=role)
        for part in parts:
            if isinstance(part, int):
                message.parts.add(image=part)
            else:
                message.parts.add(text=part)
    return request


def jpeg_bytes(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, "JPEG")
    return out.getvalue()


def placed(images: list[bytes]) -> list[PromptImage]:
    out = []
    for data in images:
        with Image.open(io.BytesIO(data)) as image:
            out.append(PromptImage(content_hash(data), image.width, image.height))
    return out


def test_a_chat_image_is_expanded_checked_and_routed_by_its_identity(
    tokenizer: Tokenizer,
) -> None:
    image = png_bytes(48, 40, 1)
    request = chat(("user", [0, "What is in the picture?"]), images=[image])
    prepared = prepare(request, tokenizer, VISION)
    assert prepared.images == (image,)
    runs = image_runs(prepared.token_ids, placed([image]), SPEC)
    rows, cols = SPEC.grid(48, 40)
    assert len(runs) == rows * cols + 1 == 5  # 2x2 tiles and the global image
    assert prepared.cache_keys is not None and has_typed_keys(prepared.cache_keys)
    assert len(prepared.cache_keys) == len(prepared.token_ids)  # one key per position
    assert prepared.text_turn is None  # an image prompt bypasses the text index
    # what the worker computes from the request it receives: the same ids
    received = GenerateRequest("r", prompt_token_ids=prepared.token_ids, images=prepared.images)
    images = validation.request_images(received, VISION)
    assert validation.prompt_ids(received, tokenizer, VISION, images) == list(prepared.token_ids)


def block_hashes(prepared: PreparedRequest) -> list[int]:
    hasher = BlockHasher(IdentityScheme(block_size=4, model_revision="test"))
    return hasher.hashes(prepared.routing_keys, DEFAULT_NAMESPACE)


def test_a_re_sent_image_hashes_to_the_same_blocks_and_another_image_does_not(
    tokenizer: Tokenizer,
) -> None:
    first, other = png_bytes(48, 40, 1), png_bytes(48, 40, 2)
    turn1 = chat(("user", [0, "Describe it."]), images=[first])
    turn2 = chat(
        ("user", [0, "Describe it."]),
        ("assistant", ["A square of noise."]),
        ("user", ["And its colours?"]),
        images=[first],
    )
    swapped = chat(("user", [0, "Describe it."]), images=[other])
    a, b, c = (prepare(r, tokenizer, VISION) for r in (turn1, turn2, swapped))
    ha, hb, hc = block_hashes(a), block_hashes(b), block_hashes(c)
    assert len(a.token_ids) == len(c.token_ids)  # equal sizes: equal positions
    full_turn1 = len(a.token_ids) // 4 - 1  # the last block may hold the generation prompt
    assert hb[:full_turn1] == ha[:full_turn1]  # turn 2 extends turn 1, image included
    image_start = image_runs(a.token_ids, placed([first]), SPEC)[0][0]
    same_text = image_start // 4  # blocks before the image's first position
    assert ha[:same_text] == hc[:same_text]
    assert all(x != y for x, y in zip(ha[same_text:], hc[same_text:], strict=True))
    assert a.token_ids == c.token_ids  # the ids alone cannot tell the images apart


def test_image_parts_are_placed_in_the_order_they_appear(tokenizer: Tokenizer) -> None:
    small, wide = png_bytes(20, 20, 3), jpeg_bytes(90, 30)
    request = chat(("user", ["first ", 1, " then ", 0]), images=[small, wide])
    prepared = prepare(request, tokenizer, VISION)
    assert prepared.images == (wide, small)
    image_runs(prepared.token_ids, placed([wide, small]), SPEC)  # raises if out of place


def test_a_text_prompt_places_images_at_its_placeholders(tokenizer: Tokenizer) -> None:
    image = png_bytes(30, 30, 4)
    request = serving_pb2.GenerateRequest(text="<image>Caption:", images=[image])
    prepared = prepare(request, tokenizer, VISION)
    assert prepared.images == (image,)
    runs = image_runs(prepared.token_ids, placed([image]), SPEC)
    assert len(runs) == SPEC.tiles(30, 30) == 5  # resized to 64 x 64: 2 x 2 tiles and global
    assert runs[0] == (2, 0, 0)  # after <fake_token_around_image><row_1_col_1>


def test_ids_with_one_image_token_are_expanded(tokenizer: Tokenizer) -> None:
    image = png_bytes(48, 40, 5)
    request = serving_pb2.GenerateRequest(images=[image])
    request.token_ids.ids.extend([5, 6, SPEC.image_token_id, 7])
    prepared = prepare(request, tokenizer, VISION)
    assert len(image_runs(prepared.token_ids, placed([image]), SPEC)) == 5
    assert prepared.token_ids[:2] == (5, 6) and prepared.token_ids[-1] == 7


@pytest.mark.parametrize(
    ("images", "fields", "named", "why"),
    [
        ([b"not an image at all"], (), "images[0]", "not an image"),
        ([png_bytes(48, 40, 1)[:200]], (), "images[0]", "truncated"),
        (
            [png_bytes(300, 300, 1)],
            ("messages[0].content[1].image_url",),
            "messages[0].content[1]",
            "pixels",
        ),
        ([png_bytes(8, 8, k) for k in range(4)], (), "images[3]", "at most 3"),
        (
            [png_bytes(8, 8, k) for k in range(4)],
            tuple(f"messages[0].content[{k}].image_url" for k in range(4)),
            "messages[0].content[3].image_url",
            "at most 3",
        ),
    ],
)
def test_bad_images_are_refused_naming_the_part(
    tokenizer: Tokenizer, images: list[bytes], fields: tuple[str, ...], named: str, why: str
) -> None:
    request = chat(("user", [*range(len(images)), "hi"]), images=images)
    with pytest.raises(InvalidRequest) as err:
        prepare(request, tokenizer, VISION, image_fields=fields)
    assert err.value.field.startswith(named) and why in str(err.value)


def test_a_bad_image_among_good_ones_is_named_after_reordering(tokenizer: Tokenizer) -> None:
    request = chat(("user", [1, "and", 0]), images=[png_bytes(8, 8, 1), b"junk"])
    fields = ("messages[0].content[2].image_url", "messages[0].content[0].image_url")
    with pytest.raises(InvalidRequest) as err:
        prepare(request, tokenizer, VISION, image_fields=fields)
    assert err.value.field == "messages[0].content[0].image_url"


def test_a_text_model_refuses_images_by_name(tokenizer: Tokenizer) -> None:
    request = chat(("user", [0, "hi"]), images=[png_bytes(8, 8, 1)])
    with pytest.raises(InvalidRequest) as err:
        prepare(request, tokenizer, TEXT_MODEL)
    assert err.value.field == "images" and "no vision encoder" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        prepare(request, tokenizer, TEXT_MODEL, image_fields=["messages[0].content[0].image_url"])
    assert err.value.field == "messages[0].content[0].image_url"


@pytest.mark.parametrize(
    ("parts", "images", "named"),
    [
        ([0, 0], 1, "chat.messages[0].parts[1].image"),  # placed twice
        ([2], 1, "chat.messages[0].parts[0].image"),  # no such image
        (["just text"], 1, "images[0]"),  # an image no part places
    ],
)
def test_chat_parts_must_place_each_image_once(
    tokenizer: Tokenizer, parts: list[str | int], images: int, named: str
) -> None:
    request = chat(("user", parts), images=[png_bytes(8, 8, k) for k in range(images)])
    with pytest.raises(InvalidRequest) as err:
        prepare(request, tokenizer, VISION)
    assert err.value.field == named


def test_content_and_parts_together_are_refused(tokenizer: Tokenizer) -> None:
    request = chat(("user", [0]), images=[png_bytes(8, 8, 1)])
    request.chat.messages[0].content = "also text"
    with pytest.raises(InvalidRequest) as err:
        prepare(request, tokenizer, VISION)
    assert err.value.field == "chat.messages[0]"


def test_a_text_prompt_cannot_smuggle_image_tokens(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequest):
        prepare(serving_pb2.GenerateRequest(text="look: <image>"), tokenizer, VISION)
    ids = serving_pb2.GenerateRequest()
    ids.token_ids.ids.extend([5, SPEC.image_token_id, 6])
    with pytest.raises(InvalidRequest):
        prepare(ids, tokenizer, VISION)


def test_text_prompts_of_a_vision_model_route_by_their_ids(tokenizer: Tokenizer) -> None:
    request = chat(("user", ["hello there"]), images=[])
    prepared = prepare(request, tokenizer, VISION)
    assert prepared.images == () and prepared.cache_keys is None
    assert prepared.routing_keys == prepared.token_ids
