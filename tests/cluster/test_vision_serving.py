"""Images end to end: a local cluster of two workers serving the tiny Idefics3 / SmolVLM checkpoint,
driven by the official `openai` and `anthropic` SDKs over real HTTP, by gRPC and by the CLI.

One cluster for the module (its start builds and loads the checkpoint). What a client must see:
an image in a data URL or a base64 block gets a completion; the next turn, sending the image
again, goes to the worker that served the first and reports the image's positions as cached,
as the router predicted; another image of the same size predicts nothing past the text before
it; every bad image is a 400 naming its part and the cluster keeps serving with nothing leaked;
images well past router.max_message_bytes in total still pass (their allowance is apart); a
stream whose worker dies continues on the other one with its image. (A text model refusing
images: tests/cluster/test_http_errors.py, test_http_anthropic.py.)
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx2 as httpx
import openai
import pytest
from PIL import Image

from cluster.cli import main as cli_main
from cluster.client import Client, text_request
from cluster.config import RouterSection
from cluster.http import openai_params
from cluster.http.openai_schema import ChatCompletionRequest
from cluster.requests import prepare
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from tests.worker.vlm_fixtures import build_tiny_vlm, png_bytes
from worker.loader import LoadedModel, load_model

MODEL = SERVED_NAME
MAX_IMAGE_BYTES = 256 << 10
MAX_PIXELS = 300 * 300
VISION_ENGINE = replace(
    ENGINE, max_images=3, max_image_pixels=MAX_PIXELS, max_image_bytes=MAX_IMAGE_BYTES
)
ROUTER = RouterSection(port=0, max_message_bytes=128 << 10)
"""Three images of up to 256 KiB pass although a message's text may be only 128 KiB."""
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm")))


@pytest.fixture(scope="module")
def cluster(vlm: LoadedModel) -> Iterator[LocalCluster]:
    cluster = start_cluster(vlm, workers=2, engine=VISION_ENGINE, router=ROUTER, http=True)
    yield cluster
    cluster.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, media_type)}}


def user_turn(*images: bytes, text: str = QUESTION) -> dict[str, Any]:
    return {"role": "user", "content": [*map(image_part, images), {"type": "text", "text": text}]}


def served_ids(
    cluster: LocalCluster, messages: list[dict[str, Any]], counting: bool = False
) -> list[int]:
    """The prompt ids the router makes of chat `messages` (images placed and expanded)."""
    body = ChatCompletionRequest(model=MODEL, messages=messages)
    message, fields = openai_params.chat_request(body, "span", "")
    limits = cluster.service.request_limits()
    assert limits is not None
    tokenizer = cluster.links.tokenizer
    prepared = prepare(message, tokenizer, limits, image_fields=fields, counting=counting)
    return list(prepared.token_ids)


def image_span(cluster: LocalCluster, messages: list[dict[str, Any]]) -> tuple[int, int]:
    """[first, last + 1) of the image positions in the prompt the router makes of `messages`."""
    limits = cluster.service.request_limits()
    assert limits is not None and limits.image_spec is not None
    token = limits.image_spec.image_token_id
    places = [i for i, t in enumerate(served_ids(cluster, messages)) if t == token]
    return places[0], places[-1] + 1


def assert_no_leak(cluster: LocalCluster) -> None:
    cluster.wait_idle()
    assert not cluster.service.in_flight


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    """The raw response (headers: the worker, the predicted cached tokens) of a greedy chat."""
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, **extra
    )


def test_a_follow_up_turn_goes_to_the_worker_holding_its_image(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    for seed in (1, 2, 3):
        turn1 = [user_turn(png_bytes(48, 40, seed))]
        raw1 = chat(client, turn1)
        first = raw1.parse()
        assert first.choices[0].finish_reason in ("stop", "length")
        assert first.usage.prompt_tokens > image_span(cluster, turn1)[1]  # the image is in it
        turn2 = [
            *turn1,
            {"role": "assistant", "content": first.choices[0].message.content or "."},
            {"role": "user", "content": "And its colours?"},
        ]
        raw2 = chat(client, turn2)
        second = raw2.parse()
        image_end = image_span(cluster, turn2)[1]
        assert raw2.headers["x-radixmesh-worker"] == raw1.headers["x-radixmesh-worker"]
        assert second.usage.prompt_tokens_details.cached_tokens >= image_end
        block = cluster.config.engine.block_size
        predicted = int(raw2.headers["x-radixmesh-predicted-cached-tokens"])
        assert predicted >= image_end // block * block  # the router knew it would hit
        cold = chat(client, turn2, extra_headers={"X-Radixmesh-Tenant": f"cold-{seed}"}).parse()
        assert cold.usage.prompt_tokens_details.cached_tokens == 0  # another tenant shares none
        assert cold.choices[0].message.content == second.choices[0].message.content
    assert_no_leak(cluster)


def test_another_image_of_the_same_size_predicts_no_hit_past_the_text(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    seen = [user_turn(png_bytes(48, 40, 11))]
    chat(client, seen)
    other = [user_turn(png_bytes(48, 40, 12))]
    start, _ = image_span(cluster, other)
    assert image_span(cluster, seen)[0] == start  # the same text before an image of one size
    raw = chat(client, other)
    assert int(raw.headers["x-radixmesh-predicted-cached-tokens"]) <= start
    assert raw.parse().usage.prompt_tokens_details.cached_tokens <= start
    assert_no_leak(cluster)


def anthropic_block(image: bytes) -> dict[str, Any]:
    """An Anthropic base64 image block of a PNG file."""
    data = base64.b64encode(image).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def test_anthropic_image_blocks_and_a_cached_follow_up(cluster: LocalCluster) -> None:
    image = png_bytes(40, 48, 21)
    block = anthropic_block(image)
    turn1: list[Any] = [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}]
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0) as sdk:
        first = sdk.messages.create(
            model=MODEL, max_tokens=6, messages=turn1, extra_body={"temperature": 0}
        )
        assert first.type == "message" and first.stop_reason in ("end_turn", "max_tokens")
        answer = "".join(b.text for b in first.content if b.type == "text") or "."
        turn2 = [
            *turn1,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And its colours?"},
        ]
        second = sdk.messages.create(
            model=MODEL, max_tokens=6, messages=turn2, extra_body={"temperature": 0}
        )
    as_openai = [user_turn(image), {"role": "assistant", "content": answer}]
    image_end = image_span(cluster, [*as_openai, {"role": "user", "content": "And its colours?"}])[
        1
    ]
    assert second.usage.cache_read_input_tokens >= image_end
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > image_end
    assert_no_leak(cluster)


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def animated_webp() -> bytes:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 0, 255))]
    return encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50)


BOMB = encoded(Image.new("RGB", (3000, 3000), (7, 7, 7)), "PNG")
"""9 megapixels in a few kilobytes: refused from its header, before a pixel is decoded."""
PART = "messages[0].content[1].image_url"
BAD_IMAGES: dict[str, tuple[list[dict[str, Any]], str, str]] = {
    "not an image": ([image_part(b"hello, this is no picture")], PART, "not an image"),
    "truncated": ([image_part(png_bytes(48, 40, 5)[:300])], PART, "truncated"),
    "decompression bomb": ([image_part(BOMB)], PART, f"at most {MAX_PIXELS}"),
    "file too large": ([image_part(png_bytes(300, 300, 6))], PART, f"at most {MAX_IMAGE_BYTES}"),
    "animated": ([image_part(animated_webp(), "image/webp")], PART, "animated"),
    "too many": (
        [image_part(png_bytes(8, 8, k)) for k in range(4)],
        "messages[0].content[4].image_url",  # the fourth image, after the text part
        "at most 3",
    ),
    "remote url": (
        [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
        PART,
        "fetches nothing",
    ),
    "bad base64": (
        [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}],
        PART,
        "does not decode",
    ),
    "media type lies": (
        [image_part(encoded(Image.new("RGB", (8, 8)), "JPEG"))],
        PART,
        "declared image/png, but the data is a JPEG",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_a_bad_image_is_a_400_naming_its_part_and_the_cluster_keeps_serving(
    client: openai.OpenAI, cluster: LocalCluster, case: str
) -> None:
    parts, named, why = BAD_IMAGES[case]
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, *parts]}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages)
    error = err.value.body
    assert isinstance(error, dict) and error["param"] == named, error
    assert error["message"].startswith(f"{named}: ") and why in error["message"], error
    good = chat(client, [user_turn(png_bytes(24, 24, 7))]).parse()
    assert good.choices[0].finish_reason in ("stop", "length")
    assert_no_leak(cluster)


def test_anthropic_refuses_bad_image_blocks_by_name(cluster: LocalCluster) -> None:
    url_block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    junk = base64.b64encode(b"not an image").decode()
    junk_block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": junk},
    }
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0) as sdk:
        for block, named, why in (
            (url_block, "messages[0].content[0].source", "fetches nothing"),
            (junk_block, "messages[0].content[0].source", "not an image"),
        ):
            content = [block, {"type": "text", "text": QUESTION}]
            with pytest.raises(anthropic.BadRequestError) as err:
                sdk.messages.create(
                    model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}]
                )
            message = err.value.body["error"]["message"]  # type: ignore[index]
            assert message.startswith(f"{named}: ") and why in message
    assert_no_leak(cluster)


def test_images_past_the_text_limit_pass_over_http_and_grpc(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    images = [png_bytes(260, 260, 30 + k) for k in range(3)]
    assert all(200_000 < len(i) <= MAX_IMAGE_BYTES for i in images)
    assert 4 * sum(map(len, images)) // 3 > ROUTER.max_message_bytes  # the body is far larger
    answer = chat(client, [user_turn(*images)]).parse()
    assert answer.choices[0].finish_reason in ("stop", "length")
    grpc_client = Client(cluster.target)
    request = text_request(chat=[("user", QUESTION)], images=images, max_tokens=4)
    last = list(grpc_client.generate(request, timeout=60))[-1]
    assert last.finished and last.finish_reason in ("stop", "length")
    assert last.cached_prompt_tokens > 0  # the same images, rendered the same: a hit
    too_much_text = text_request(chat=[("user", "x" * (150 << 10))], images=images[:1])
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_client.generate(too_much_text, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "besides its images" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_client.generate(text_request(chat=[("user", "hi")], images=[b"junk"])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("images[0]: not an image")
    grpc_client.close()
    assert_no_leak(cluster)


def test_generate_with_an_image_on_the_command_line(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "noise.png"
    path.write_bytes(png_bytes(32, 32, 40))
    args = ["generate", "--target", cluster.target, "--max-tokens", "4", "--image", str(path)]
    assert cli_main([*args, QUESTION]) == 0
    assert "prompt tokens" in capsys.readouterr().err
    assert cli_main([*args[:-1], str(tmp_path / "missing.png"), QUESTION]) == 2
    assert "--image" in capsys.readouterr().err


def test_a_stream_whose_worker_dies_continues_with_its_image(cluster: LocalCluster) -> None:
    """Last: it kills a worker (and starts another in its place)."""
    request = text_request(
        chat=[("user", "Describe the picture at length.")],
        images=[png_bytes(48, 40, 50)],
        max_tokens=300,
    )
    request.sampling.ignore_eos = True
    client = Client(cluster.target)
    undisturbed = list(client.generate(request, timeout=120))
    expected = [t for m in undisturbed for t in m.token_ids]
    assert len(expected) == 300
    stream = client.generate(request, timeout=120)
    got, worker = [], ""
    for message in stream:
        got.extend(message.token_ids)
        worker = worker or message.worker
        if worker in cluster.engines:  # at its first message: 300 tokens are still to come
            cluster.kill_worker(worker)
            worker = "killed"
    assert worker == "killed"
    assert got == expected  # continued token for token on the other worker, image and all
    assert cluster.service.counters.migrated >= 1
    cluster.add_worker("worker-2")
    assert_no_leak(cluster)
    client.close()


def test_tokenize_counts_a_vision_models_chat_as_it_is_served(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """SmolVLM's template renders only content parts: /tokenize must hand it parts, as serving
    does, or a text message renders empty. With images, the count and the ids are the served
    prompt's, each image expanded into its tiles' image tokens; a broken image, or a setting the
    served rendering cannot honour, is refused by name."""
    tokenize = f"{cluster.http_url}/tokenize"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count these words, please."}]
    served = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    counted = httpx.post(tokenize, json={"messages": messages}).json()
    assert counted["count"] == served.usage.prompt_tokens
    for images in ([png_bytes(40, 48, 21)], [png_bytes(64, 30, 22), png_bytes(20, 20, 23)]):
        turn = [user_turn(*images)]
        served = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=1)  # type: ignore[arg-type]
        counted = httpx.post(tokenize, json={"messages": turn}).json()
        assert counted["count"] == served.usage.prompt_tokens == len(counted["tokens"])
        assert counted["tokens"] == served_ids(cluster, turn)
        spec = cluster.service.request_limits().image_spec  # type: ignore[union-attr]
        assert spec is not None
        expanded = counted["tokens"].count(spec.image_token_id)
        assert expanded >= len(images) * spec.image_seq_len  # each image: its tiles' runs
        assert expanded % spec.image_seq_len == 0
    # a count may exceed the context, as a text prompt's does; serving it is refused
    long = [user_turn(png_bytes(40, 48, 21), text="word " * 600)]
    counted = httpx.post(tokenize, json={"messages": long}).json()
    assert counted["count"] > counted["max_model_len"] == ENGINE.max_model_len
    assert counted["tokens"] == served_ids(cluster, long, counting=True)
    with pytest.raises(openai.BadRequestError, match="leave no room to generate"):
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=1)  # type: ignore[arg-type]
    broken = httpx.post(tokenize, json={"messages": [user_turn(b"x")]})
    assert broken.status_code == 400
    assert broken.json()["error"]["param"] == "messages[0].content[0].image_url"
    bare = {"messages": [user_turn(png_bytes(40, 48, 21))], "add_generation_prompt": False}
    refused = httpx.post(tokenize, json=bare)
    assert (
        refused.status_code == 400 and refused.json()["error"]["param"] == "add_generation_prompt"
    )
    assert_no_leak(cluster)


def test_anthropic_count_tokens_counts_image_blocks_as_served(cluster: LocalCluster) -> None:
    """count_tokens with an image block (the real SDK): the input tokens a /v1/messages request
    of the same content reports; a broken block is a 400 naming it."""
    image = png_bytes(40, 48, 24)
    block = anthropic_block(image)
    turn: list[Any] = [{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}]
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0) as sdk:
        counted = sdk.messages.count_tokens(model=MODEL, messages=turn)
        served = sdk.messages.create(model=MODEL, max_tokens=1, messages=turn)
        assert counted.input_tokens == (
            served.usage.input_tokens + (served.usage.cache_read_input_tokens or 0)
        )
        assert counted.input_tokens == len(served_ids(cluster, [user_turn(image)]))
        long = [{"role": "user", "content": [block, {"type": "text", "text": "word " * 600}]}]
        assert sdk.messages.count_tokens(model=MODEL, messages=long).input_tokens > 512
        bad = {**block, "source": {**block["source"], "data": base64.b64encode(b"x").decode()}}
        with pytest.raises(anthropic.BadRequestError) as err:
            sdk.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [bad]}])
        assert "messages[0].content[0].source" in str(err.value)
    assert_no_leak(cluster)
