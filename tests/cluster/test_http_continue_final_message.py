"""A chat's last message continued over HTTP: vLLM's `continue_final_message` on the OpenAI
API and Anthropic's prefill (a final assistant message), through the `openai` and `anthropic`
SDKs to a local cluster of two tiny-model workers. The answer must be exactly what the
completions API writes after the same prompt ids: the conversation, its generation prompt, the
message's text, and nothing closing the turn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2 as httpx
import openai
import pytest

from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
ASK: list[Any] = [{"role": "user", "content": "Name a colour of the sky."}]
PREFILL = "The sky is"


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def continued_ids(cluster: LocalCluster) -> list[int]:
    """The prompt a continued turn must be: the conversation opened for the reply, the text."""
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    text = tokenizer.apply_chat_template(ASK) + PREFILL
    return tokenizer.encode(text, add_special_tokens=False)


def completion_after(client: openai.OpenAI, ids: list[int]) -> str:
    reply = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return reply.choices[0].text


def test_openai_continue_final_message_writes_on_from_the_text(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    ids = continued_ids(cluster)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[*ASK, {"role": "assistant", "content": PREFILL}],
        max_tokens=8,
        temperature=0,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "ignore_eos": True,
        },
    )
    assert answer.choices[0].message.content == completion_after(client, ids)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    counted = httpx.post(
        f"{cluster.http_url}/tokenize",
        json={
            "messages": [*ASK, {"role": "assistant", "content": PREFILL}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ).json()
    assert counted["tokens"] == ids
    answered = client.chat.completions.create(  # without it, the assistant turn is closed
        model=MODEL,
        messages=[*ASK, {"role": "assistant", "content": PREFILL}],
        max_tokens=1,
    )
    assert answered.usage is not None and answered.usage.prompt_tokens > len(ids)
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    unopened = client.chat.completions.create(  # vLLM's add_generation_prompt alone
        model=MODEL, messages=ASK, max_tokens=1, extra_body={"add_generation_prompt": False}
    )
    closed = tokenizer.apply_chat_template(ASK, add_generation_prompt=False)
    assert unopened.usage is not None
    assert unopened.usage.prompt_tokens == len(tokenizer.encode(closed, add_special_tokens=False))
    assert_no_leak(cluster)


def test_anthropic_prefill_continues_the_assistant_turn(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    ids = continued_ids(cluster)
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0) as sdk:
        chat = [*ASK, {"role": "assistant", "content": PREFILL}]
        reply = sdk.messages.create(
            model=MODEL, max_tokens=8, messages=chat, extra_body={"temperature": 0}
        )
        count = sdk.messages.count_tokens(model=MODEL, messages=chat)
    text = "".join(block.text for block in reply.content if block.type == "text")
    expected = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert text == expected.choices[0].text
    assert count.input_tokens == len(ids)
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == len(ids)
    assert_no_leak(cluster)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            "add_generation_prompt",
            "true with continue_final_message",
        ),
        (
            {"continue_final_message": True, "last": "  "},
            "messages",
            "the last message is empty",
        ),
    ],
)
def test_what_cannot_be_continued_is_a_400_naming_it(
    cluster: LocalCluster, body: dict[str, Any], param: str, words: str
) -> None:
    last = body.pop("last", PREFILL)
    request = {
        "model": MODEL,
        "messages": [*ASK, {"role": "assistant", "content": last}],
        "max_tokens": 4,
        **body,
    }
    reply = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=request)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert_no_leak(cluster)


def test_a_last_message_of_tool_calls_is_not_continued(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = {
        "model": MODEL,
        "messages": [*ASK, {"role": "assistant", "content": "Let me check.", "tool_calls": [call]}],
        "max_tokens": 2,
        "continue_final_message": True,
    }
    reply = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=request)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "continue_final_message"
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="none", max_retries=0) as sdk:
        tool_use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
        answered = sdk.messages.create(  # a closed turn, answered in a new one
            model=MODEL,
            max_tokens=2,
            messages=[*ASK, {"role": "assistant", "content": [tool_use]}],
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )
    assert answered.stop_reason in ("max_tokens", "end_turn", "tool_use")
    assert_no_leak(cluster)
