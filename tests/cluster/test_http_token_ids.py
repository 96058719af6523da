"""vLLM's `return_token_ids` (what RL and agent frameworks read to train on the tokens served)
through the `openai` SDK over real HTTP on loopback to a local cluster of two tiny-model
workers: the prompt's ids as the worker templated and tokenized it (`/tokenize`'s), each
choice's generated ids (their text is the choice's), streamed as vLLM streams them: the prompt's
in the first chunk, each chunk's new tokens in it, none lost where text is held back; absent
unless asked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.http.openai_responses import Reply, chat_chunks, completion_chunks
from cluster.http.openai_schema import StreamOptions
from cluster.http.token_texts import TokenTexts
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe."}]
ASKED = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def tokenized(cluster: LocalCluster, **body: Any) -> list[int]:
    answer = httpx.post(f"{cluster.http_url}/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 200, answer.text
    tokens: list[int] = answer.json()["tokens"]
    return tokens


def decoded(cluster: LocalCluster, ids: list[int]) -> str:
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    text: str = tokenizer.decode(ids)
    return text


def test_a_chat_completion_carries_its_prompts_and_its_choices_ids(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, n=2, seed=3, extra_body=ASKED
    )
    raw = answer.model_dump()
    prompt = raw["prompt_token_ids"]
    assert prompt == tokenized(cluster, messages=MESSAGES)
    assert len(prompt) == answer.usage.prompt_tokens  # type: ignore[union-attr]
    for choice in raw["choices"]:
        assert len(choice["token_ids"]) == 9
        assert decoded(cluster, choice["token_ids"]) == choice["message"]["content"]
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert "prompt_token_ids" not in plain.model_dump()
    assert "token_ids" not in plain.model_dump()["choices"][0]
    assert_no_leak(cluster)


def test_a_streamed_chat_gives_the_prompts_ids_first_and_each_chunks_tokens(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body=ASKED
    ).model_dump()
    chunks = [
        c.model_dump()
        for c in client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body=ASKED,
        )
    ]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"]
    assert_no_leak(cluster)


def test_completions_carry_each_prompts_ids_whole_and_streamed(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    prompts = ["The river Danube", "Mountains of the north are"]
    seeded: dict[str, Any] = {"max_tokens": 7, "n": 2, "seed": 3, "extra_body": ASKED}
    whole = client.completions.create(model=MODEL, prompt=prompts, **seeded).model_dump()
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        prompt = prompts[choice["index"] // 2]
        assert choice["prompt_token_ids"] == tokenized(cluster, prompt=prompt)
        assert decoded(cluster, choice["token_ids"]) == choice["text"]
        assert len(choice["token_ids"]) == 7
    stream = client.completions.create(model=MODEL, prompt=prompts, stream=True, **seeded)
    prompt_ids: dict[int, list[int]] = {}
    generated: dict[int, list[int]] = {}
    for chunk in stream:
        for choice in chunk.model_dump()["choices"]:
            index = choice["index"]
            if "prompt_token_ids" in choice:
                assert index not in prompt_ids  # in a choice's first chunk only
                prompt_ids[index] = choice["prompt_token_ids"]
            generated.setdefault(index, []).extend(choice.get("token_ids", []))
    assert prompt_ids == {i: tokenized(cluster, prompt=prompts[i // 2]) for i in range(4)}
    assert generated == {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert_no_leak(cluster)


def message(index: int, ids: list[int], text: str, **extra: Any) -> serving_pb2.GenerateResponse:
    return serving_pb2.GenerateResponse(
        request_id="r", index=index, token_ids=ids, text=text, worker="w", **extra
    )


async def made_up(messages: list[serving_pb2.GenerateResponse]) -> AsyncIterator[Any]:
    for each in messages:
        yield each


def events(frames: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(f[len(b"data: ") :]) for f in frames if not f.startswith(b"data: [DONE]")]


@pytest.mark.parametrize("chat", [True, False])
def test_tokens_whose_text_is_held_back_go_with_the_next_chunk(
    cluster: LocalCluster, chat: bool
) -> None:
    """A message with no text (held back: a possible stop string) makes no chunk; its tokens
    come in the next one, so the stream's token ids are every token, once."""
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    reply = Reply("x", MODEL, TokenTexts(tokenizer), token_ids=True, request_ids=["r"])
    stream = made_up(
        [
            message(0, [5], "a", prompt_token_ids=[1, 2, 3], prompt_tokens=3),
            message(0, [6], ""),  # held back
            message(0, [7], ""),
            message(0, [8], "bcd"),
            message(0, [9], "", finished=True, finish_reason="length"),
        ]
    )
    chunks = chat_chunks if chat else completion_chunks

    async def run() -> list[bytes]:
        return [frame async for frame in chunks(reply, stream, StreamOptions(), False)]  # type: ignore[operator]

    got = events(asyncio.run(run()))
    ids = [c["choices"][0].get("token_ids") for c in got if c["choices"]]
    expected = [None, [5], [6, 7, 8], [9]] if chat else [[5], [6, 7, 8], [9]]
    assert ids == expected
    if chat:
        assert got[0]["prompt_token_ids"] == [1, 2, 3]
    else:
        assert got[0]["choices"][0]["prompt_token_ids"] == [1, 2, 3]


def test_every_streamed_chat_choice_begins_with_the_prompts_ids(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """As vLLM streams n choices: each choice's first (role) chunk carries the prompt's ids."""
    chunks = [
        c.model_dump()
        for c in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, n=3, seed=5, stream=True, extra_body=ASKED
        )
    ]
    prompt = tokenized(cluster, messages=MESSAGES)
    firsts: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], chunk)
    assert sorted(firsts) == [0, 1, 2]
    assert all(first["prompt_token_ids"] == prompt for first in firsts.values())
    assert sum("prompt_token_ids" in c for c in chunks) == 3  # there, and nowhere else
    assert_no_leak(cluster)
