"""A message's `name` (OpenAI's participant name, which multi-agent frameworks send to tell
agents of one role apart) is given to the chat template as the message's name, as transformers
and vLLM give it: a template that writes it makes it part of the prompt, one that does not
serves the conversation as without names. Real HTTP on loopback with the `openai` SDK; the
tiny model with its own template (no names) and with one that writes them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest

from cluster.client import Client, text_request
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_http_errors import assert_openai_error
from tests.cluster.tool_fixtures import openai_client
from worker.loader import LoadedModel, load_model

MODEL = SERVED_NAME
NAMED = [
    {"role": "system", "content": "Two agents talk.", "name": "host"},
    {"role": "user", "content": "the quick brown fox", "name": "ada"},
    {"role": "assistant", "content": "jumps over", "name": "planner"},
    {"role": "user", "content": "the lazy dog", "name": "grace"},
]
UNNAMED = [{k: v for k, v in m.items() if k != "name"} for m in NAMED]
GREEDY: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
NAME_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] }}"
    "{% if message.name is defined %}{{ ' ' + message.name }}{% endif %}"
    "{{ '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with the speaker's name after the role, as some multi-agent templates write it."""


@pytest.fixture(scope="module")
def naming(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    path = tmp_path_factory.mktemp("naming") / "model"
    shutil.copytree(tiny.path, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = NAME_TEMPLATE
    config_file.write_text(json.dumps(config))
    running = start_cluster(load_model(path), workers=1, http=True)
    yield running
    running.close()


def prompt_tokens(client: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[int, str]:
    reply = client.chat.completions.create(messages=messages, **GREEDY)  # type: ignore[arg-type]
    assert reply.usage is not None
    return reply.usage.prompt_tokens, reply.choices[0].message.content or ""


def tokens(cluster: LocalCluster, **asked: Any) -> list[int]:
    body = {"model": MODEL, **asked}
    response = httpx.post(f"{cluster.http_url}/tokenize", json=body, timeout=30)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["tokens"]
    return ids


def test_a_template_without_names_serves_the_conversation_as_unnamed(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    assert prompt_tokens(client, NAMED) == prompt_tokens(client, UNNAMED)
    assert tokens(cluster, messages=NAMED) == tokens(cluster, messages=UNNAMED)
    cluster.wait_idle()


def test_a_template_that_writes_names_gets_them(naming: LocalCluster) -> None:
    """The prompt is the conversation with each name after its role, token for token, and the
    chat is served with that many prompt tokens."""
    written = "".join(
        f"<|im_start|>{m['role']} {m['name']}\n{m['content']}<|im_end|>\n" for m in NAMED
    )
    expected = tokens(naming, prompt=written + "<|im_start|>assistant\n", add_special_tokens=False)
    assert tokens(naming, messages=NAMED) == expected
    for client in openai_client(naming):
        named, _ = prompt_tokens(client, NAMED)
        unnamed, _ = prompt_tokens(client, UNNAMED)
        assert named == len(expected) > unnamed
    naming.wait_idle()


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"role": "tool", "tool_call_id": "c", "content": "x", "name": "f"}, "a tool message"),
        ({"role": "user", "content": "x", "name": 5}, "participant's name"),
        ({"role": "user", "content": "x", "name": "two words"}, "without whitespace"),
        ({"role": "user", "content": "x", "name": "x<|im_start|>"}, "any of <"),
        ({"role": "user", "content": "x", "name": "a" * 65}, "1-64 characters"),
        ({"role": "user", "content": "x", "name": ""}, "1-64 characters"),
    ],
)
def test_a_bad_name_is_refused_by_name(
    cluster: LocalCluster, message: dict[str, Any], words: str
) -> None:
    body = {**GREEDY, "messages": [{"role": "user", "content": "hi"}, message]}
    response = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=30)
    assert assert_openai_error(response, 400, words)["param"] == "messages[1].name"
    cluster.wait_idle()


def test_grpc_checks_a_name_as_http_does(cluster: LocalCluster) -> None:
    """The serving core refuses what the HTTP face does, naming the field as gRPC has it."""
    client = Client(cluster.target)
    try:
        for role, name, words in (("tool", "f", "a tool message"), ("user", "a b", "whitespace")):
            request = text_request(chat=[("user", "hi")], max_tokens=2)
            turn = request.chat.messages.add(role=role, content="x", name=name)
            if role == "tool":
                turn.tool_call_id = "c"
            with pytest.raises(grpc.RpcError) as refused:
                list(client.generate(request, timeout=30))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("chat.messages[1].name: ")
            assert words in refused.value.details()
    finally:
        client.close()
    cluster.wait_idle()
