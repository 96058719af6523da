"""SGLang's `/generate` with `image_data` on a real cluster serving the tiny vision model: the
images take the prompt's `<image>` places as they do for a gRPC text prompt with images, given
as data URLs or bare base64, alone or in a batch; what cannot be read is refused naming
`image_data`, and the server fetches nothing."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from cluster.client import Client, text_request
from tests.cluster.local_cluster import LocalCluster, start_cluster
from tests.cluster.test_vision_serving import ROUTER, VISION_ENGINE
from tests.worker.vlm_fixtures import build_tiny_vlm, png_bytes
from worker.loader import load_model

PICTURE = png_bytes(60, 40, seed=1)
OTHER = png_bytes(40, 40, seed=2)
GIF = b"GIF89a" + bytes(32)
TEXT = "Look: <image> What is it?"
GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    vlm = load_model(build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm")))
    running = start_cluster(vlm, workers=1, engine=VISION_ENGINE, router=ROUTER, http=True)
    yield running
    running.close()


def url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def generate(cluster: LocalCluster, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{cluster.http_url}/generate", json=body, timeout=120)


def by_grpc(cluster: LocalCluster, text: str, images: list[bytes]) -> tuple[str, int]:
    request = text_request(text, max_tokens=6, images=images)
    answers = list(Client(cluster.target).generate(request, timeout=120))
    return "".join(a.text for a in answers), answers[0].prompt_tokens


def test_images_take_the_prompts_places_as_over_grpc(cluster: LocalCluster) -> None:
    text, prompt = by_grpc(cluster, TEXT, [PICTURE])
    for given in (url(PICTURE), [url(PICTURE)], base64.b64encode(PICTURE).decode()):
        answer = generate(cluster, {"text": TEXT, "image_data": given, "sampling_params": GREEDY})
        assert answer.status_code == 200, answer.text
        out = answer.json()
        assert (out["text"], out["meta_info"]["prompt_tokens"]) == (text, prompt)
    other, _ = by_grpc(cluster, "Plain words.", [])
    both = generate(
        cluster,
        {
            "text": [TEXT, "Plain words."],
            "image_data": [url(PICTURE), None],
            "sampling_params": GREEDY,
        },
    )
    assert [b["text"] for b in both.json()] == [text, other]
    shared = {"text": [TEXT, TEXT], "image_data": url(PICTURE), "sampling_params": GREEDY}
    assert [b["text"] for b in generate(cluster, shared).json()] == [text, text]  # SGLang's
    none = {"text": ["Plain words.", "Plain words."], "image_data": [], "sampling_params": GREEDY}
    assert [b["text"] for b in generate(cluster, none).json()] == [other, other]
    skipped = {"text": [TEXT, "Plain words."], "image_data": [[url(PICTURE)], [None]]}
    answers = generate(cluster, {**skipped, "sampling_params": GREEDY}).json()
    assert [b["text"] for b in answers] == [text, other]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": TEXT, "image_data": "https://example.com/a.png"}, "image_data", "fetches"),
        ({"text": TEXT, "image_data": ["aGVsbG8="]}, "image_data[0]", "no PNG, JPEG or WebP"),
        ({"text": TEXT, "image_data": [url(PICTURE), url(OTHER)]}, "image_data", "2 images"),
        ({"text": [TEXT, TEXT], "image_data": [url(PICTURE)]}, "image_data", "one entry per"),
        (
            {"text": TEXT, "image_data": [base64.b64encode(GIF).decode()]},
            "image_data[0]",
            "no PNG, JPEG or WebP",
        ),
        ({"text": TEXT, "image_data": "/etc/passwd"}, "image_data", "neither a data URL"),
    ],
)
def test_what_cannot_be_read_is_refused_naming_image_data(
    cluster: LocalCluster, body: dict[str, Any], param: str, words: str
) -> None:
    answer = generate(cluster, {**body, "sampling_params": GREEDY})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
