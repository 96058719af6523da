"""vLLM's `chat_template_kwargs`: more variables for the chat template, as Qwen3's
`enable_thinking` is set, through the OpenAI SDK (extra_body) to a local cluster whose tiny
model has a template that reads one; the template's own names are refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from worker.loader import load_model
from worker.tiny_model import CHATML_TEMPLATE, build_tiny_checkpoint

MODEL = SERVED_NAME
THINKING_SWITCH = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}",
)
CHAT = [{"role": "user", "content": "Is the cache warm?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("thinking") / "tiny")
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    assert config["chat_template"] != THINKING_SWITCH
    config["chat_template"] = THINKING_SWITCH
    config_file.write_text(json.dumps(config))
    cluster = start_cluster(load_model(path), http=True)
    yield cluster
    cluster.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def prompt_tokens(client: openai.OpenAI, **extra: object) -> int:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=1,
        temperature=0,
        extra_body=extra or None,  # type: ignore[arg-type]
    )
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def test_a_variable_reaches_the_template(client: openai.OpenAI, cluster: LocalCluster) -> None:
    plain = prompt_tokens(client)
    thinking = prompt_tokens(client, chat_template_kwargs={"enable_thinking": True})
    not_thinking = prompt_tokens(client, chat_template_kwargs={"enable_thinking": False})
    assert plain == thinking < not_thinking  # the empty think block is written
    cluster.wait_idle()


@pytest.mark.parametrize(
    ("variables", "param", "words"),
    [
        ({"messages": []}, "chat_template_kwargs.messages", "the renderer's to give"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt", ""),
        ({"not a name": 1}, "chat_template_kwargs", "is not a template variable's name"),
    ],
)
def test_the_templates_own_names_are_refused(
    client: openai.OpenAI,
    cluster: LocalCluster,
    variables: dict[str, object],
    param: str,
    words: str,
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        prompt_tokens(client, chat_template_kwargs=variables)
    error = err.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert words in error["message"]
    cluster.wait_idle()
    assert not cluster.service.in_flight
