"""OpenAI's predicted outputs through the `openai` SDK, over real HTTP and gRPC on loopback,
against a local cluster of two tiny-model workers (tests/cluster/conftest.py's `cluster` and
`client`): a prediction changes no answer, and the usage says how much of it the answer was."""

from __future__ import annotations

import re
import threading
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.client import Client, text_request
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from worker.loader import LoadedModel

CHAT = [{"role": "user", "content": "Rewrite this in the same words."}]


@pytest.fixture(scope="module")
def words(tiny: LoadedModel) -> list[int]:
    """Tokens that each spell a space and a word and spell back to themselves: an answer of
    them tokenizes back to itself, so a prediction made of its text can match it whole."""
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    return [
        t
        for t in range(tiny.config.vocab_size)
        if re.fullmatch(r" [a-z]+", text := tokenizer.decode([t]))
        and tokenizer.encode(text, add_special_tokens=False) == [t]
    ]


def _ask(client: openai.OpenAI, words: list[int], **more: Any) -> Any:
    extra = {"allowed_token_ids": words, "ignore_eos": True} | more.pop("extra_body", {})
    return client.chat.completions.create(
        model=SERVED_NAME,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        extra_body=extra,
        **more,
    )


def _assert_no_leak(cluster: LocalCluster) -> None:
    cluster.wait_idle(20)
    assert not cluster.service.in_flight


def test_a_prediction_of_the_answer_is_accepted_whole(
    client: openai.OpenAI, cluster: LocalCluster, words: list[int]
) -> None:
    plain = _ask(client, words)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens == 40
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    predicted = _ask(client, words, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (40, 0)
    assert predicted.usage.completion_tokens == 40
    # the same as text parts, and streamed: the usage comes in the last chunk
    half = len(answer) // 2
    parts = [{"type": "text", "text": answer[:half]}, {"type": "text", "text": answer[half:]}]
    stream = _ask(
        client,
        words,
        prediction={"type": "content", "content": parts},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.accepted_prediction_tokens == 40
    _assert_no_leak(cluster)


def test_an_edited_prediction_changes_nothing_and_counts_what_was_computed_in_vain(
    client: openai.OpenAI, cluster: LocalCluster, words: list[int], tiny: LoadedModel
) -> None:
    answer = _ask(client, words).choices[0].message.content
    cut = answer.index(" ", len(answer) // 2)
    edited = answer[:cut] + " banana split" + answer[cut:]
    predicted = _ask(client, words, prediction={"type": "content", "content": edited})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    assert 20 < details.accepted_prediction_tokens < 40
    # the draft that ran into the edit was verified and not drawn
    assert details.rejected_prediction_tokens > 0
    _assert_no_leak(cluster)


@pytest.mark.parametrize(
    ("prediction", "words"),
    [
        ({"type": "text", "content": "x"}, "'content'"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "text parts"),
        ({"type": "content", "content": [{"type": "text", "text": "a", "x": 1}]}, "text parts"),
        ({"type": "content", "content": [{"type": "text"}]}, "text parts"),
    ],
)
def test_a_malformed_prediction_is_a_400_naming_it(
    cluster: LocalCluster, prediction: dict[str, Any], words: str
) -> None:
    body = {"model": SERVED_NAME, "messages": CHAT, "max_tokens": 4, "prediction": prediction}
    reply = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith("prediction") and words in error["message"], error
    if words == "text parts":
        assert error["param"] == "prediction.content[0]"
    body.pop("prediction")
    assert httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body).status_code == 200
    _assert_no_leak(cluster)


def test_a_prediction_over_grpc(cluster: LocalCluster, tiny: LoadedModel) -> None:
    request = text_request("the quick brown", max_tokens=30)
    request.sampling.ignore_eos = True
    client = Client(cluster.target)
    plain = list(client.generate(request, timeout=30))
    answer = [t for r in plain for t in r.token_ids]
    assert tiny.tokenizer is not None
    predicted = text_request("the quick brown", max_tokens=30)
    predicted.sampling.ignore_eos = True
    predicted.sampling.prediction = tiny.tokenizer.decode(answer[:20]) + " zebra"
    responses = list(client.generate(predicted, timeout=30))
    client.close()
    assert [t for r in responses for t in r.token_ids] == answer
    accepted = sum(r.accepted_prediction_tokens for r in responses)
    assert 0 < accepted <= 20
    _assert_no_leak(cluster)


def test_a_prediction_is_tokenized_off_the_workers_event_loop(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large prediction takes the tokenizer a while: the worker submits it from a thread of
    its own, as it does images, so its gRPC event loop (the local cluster's thread) goes on
    streaming every other request meanwhile."""
    threads: list[str] = []
    for engine in cluster.engines.values():
        submit = engine.submit

        def recorded(request: Any, sink: Any, submit: Any = submit) -> int:
            if request.sampling.prediction:
                threads.append(threading.current_thread().name)
            return submit(request, sink)

        monkeypatch.setattr(engine, "submit", recorded)
    request = text_request("the quick brown", max_tokens=4)
    request.sampling.prediction = " the quick brown fox" * 200
    client = Client(cluster.target)
    assert len([t for r in client.generate(request, timeout=30) for t in r.token_ids]) == 4
    client.close()
    assert len(threads) == 1 and threads[0] != "local-cluster", threads
    _assert_no_leak(cluster)
