"""Several prompts in one completions request (OpenAI's legacy API; lm-evaluation-harness's
batches): choice p x n + i is sample i of prompt p, each exactly what the prompt alone gets; the
usage sums the prompts; a refusal of any prompt refuses the request before a byte is sent; a
client that goes away cancels every prompt's generation. Real HTTP on loopback to a local
cluster of two tiny-model workers, with the `openai` SDK."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.requests import suffixed
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
PROMPTS = ["the quick brown fox", "jumps over the lazy dog", "a cache keeps the prefix"]


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


ASK: dict[str, Any] = {"max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 2}


def test_each_prompts_choices_are_what_it_gets_alone(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    together = client.completions.create(model=MODEL, prompt=PROMPTS, **ASK)
    alone = [client.completions.create(model=MODEL, prompt=p, **ASK) for p in PROMPTS]
    assert [c.index for c in together.choices] == list(range(6))
    for p, single in enumerate(alone):
        for i in range(2):
            choice = together.choices[p * 2 + i]
            assert choice.text == single.choices[i].text, f"prompt {p}, sample {i}"
            assert choice.finish_reason == single.choices[i].finish_reason
    assert together.usage is not None
    singles = [a.usage for a in alone]
    assert together.usage.prompt_tokens == sum(u.prompt_tokens for u in singles if u)
    assert together.usage.completion_tokens == sum(u.completion_tokens for u in singles if u)
    assert_no_leak(cluster)


def test_a_streamed_batch_carries_the_same_choices(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, **ASK)
    texts: dict[int, str] = defaultdict(str)
    finished = set()
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, stream=True, **ASK):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert finished == set(range(6))
    assert_no_leak(cluster)


def test_an_lm_eval_batch_of_token_prompts_scores_each(cluster: LocalCluster) -> None:
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    batch = [tokenizer.encode(p) for p in PROMPTS]
    payload = {"model": MODEL, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    url = f"{cluster.http_url}/v1/completions"
    together = httpx.post(url, json={**payload, "prompt": batch}).json()["choices"]
    for p, ids in enumerate(batch):
        (alone,) = httpx.post(url, json={**payload, "prompt": [ids]}).json()["choices"]
        got = together[p]
        assert got["index"] == p
        assert got["logprobs"]["tokens"][: len(ids)] == alone["logprobs"]["tokens"][: len(ids)]
        assert got["logprobs"]["token_logprobs"][: len(ids)] == pytest.approx(
            alone["logprobs"]["token_logprobs"][: len(ids)], abs=1e-5
        )
        assert got["text"].startswith(tokenizer.decode(ids, skip_special_tokens=False))
    assert_no_leak(cluster)


def test_one_bad_prompt_refuses_the_request_and_frees_the_others(
    cluster: LocalCluster,
) -> None:
    body = {
        "model": MODEL,
        "prompt": [[5, 6, 7], [5, 10**6]],
        "max_tokens": 300,
        "stream": True,
        "ignore_eos": True,
    }
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert "outside the vocabulary" in reply.json()["error"]["message"]
    assert_no_leak(cluster)
    ok = httpx.post(f"{cluster.http_url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert ok.status_code == 200


def test_a_client_that_goes_away_cancels_every_prompt(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPTS,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    release = cluster.hold_engines_after(8, monkeypatch)
    try:
        with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection
            first = json.loads(next(lines)[len("data: ") :])
            assert first["choices"][0]["index"] in range(3)
            assert len(cluster.service.in_flight) == 3, cluster.service.in_flight
        left = time.monotonic()
        while cluster.service.in_flight and time.monotonic() - left < 5.0:
            time.sleep(0.01)
        assert not cluster.service.in_flight, "a prompt's generation outlived its client"
    finally:
        release.set()
    assert_no_leak(cluster)


def test_an_x_request_id_of_any_valid_length_serves_several_prompts(
    cluster: LocalCluster,
) -> None:
    """Each prompt runs under the header's id and its index, cut to the 128 characters an id
    may have when the two are longer (two long ids that begin alike stay apart); a header
    that cannot be an id is refused naming it, on every API."""
    one, other = suffixed("a" * 127 + "b", "-1"), suffixed("a" * 128, "-1")
    assert one != other and len(one) == len(other) == 128 and one.endswith("-1")
    assert suffixed("x", "-1") == "x-1"
    url = f"{cluster.http_url}/v1/completions"
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 2, "temperature": 0}
    for header in ("a" * 127 + "b", "a" * 128, "x"):
        answer = httpx.post(url, json=body, headers={"x-request-id": header}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["id"] == f"cmpl-{header}"
    sglang = {"text": PROMPTS[:2], "rid": "r" * 127, "sampling_params": {"max_new_tokens": 2}}
    answer = httpx.post(f"{cluster.http_url}/generate", json=sglang, timeout=60)
    assert answer.status_code == 200, answer.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, sent in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        for header in ("a" * 129, "has space"):
            refused = httpx.post(
                f"{cluster.http_url}{path}", json=sent, headers={"x-request-id": header}
            )
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "X-Request-Id"
    assert_no_leak(cluster)
