"""vLLM's `truncate_prompt_tokens` through the `openai` SDK over real HTTP on loopback to a
local cluster of two tiny-model workers: only the prompt's last k tokens are served (the
answer is the one those tokens sent as the prompt get, and the usage counts k), on
completions, chat and embeddings; -1 cuts a prompt past the context to the context; what is
not served with it is refused by name, and the cluster serves on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster.requests import truncated_prompt
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.test_http_token_ids import tokenized
from tests.cluster.tool_fixtures import served
from worker.errors import InvalidRequest
from worker.loader import LoadedModel

MODEL = SERVED_NAME
PROMPT = "The router sends each prompt to the worker whose cache holds its longest prefix."


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def test_a_completion_serves_the_prompts_last_tokens(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    ids = tokenized(cluster, prompt=PROMPT)
    greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    cut = client.completions.create(
        prompt=PROMPT, **greedy, extra_body={"truncate_prompt_tokens": 7}
    )
    alone = client.completions.create(prompt=ids[-7:], **greedy)
    assert cut.usage is not None and cut.usage.prompt_tokens == 7
    assert cut.choices[0].text == alone.choices[0].text
    whole = client.completions.create(
        prompt=PROMPT, **greedy, extra_body={"truncate_prompt_tokens": len(ids) + 5}
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)  # not longer
    assert_no_leak(cluster)


def test_a_chat_and_an_embedding_are_cut_too(client: openai.OpenAI, cluster: LocalCluster) -> None:
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Why?"}]
    templated = tokenized(cluster, messages=messages)
    cut = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 9, "return_token_ids": True},
    )
    assert cut.usage is not None and cut.usage.prompt_tokens == 9
    assert cut.model_dump()["prompt_token_ids"] == templated[-9:]  # the served ids
    embedded = client.embeddings.create(
        model=MODEL, input=PROMPT, extra_body={"truncate_prompt_tokens": 5}
    )
    ids = tokenized(cluster, prompt=PROMPT)
    alone = client.embeddings.create(model=MODEL, input=[ids[-5:]])
    assert embedded.usage.prompt_tokens == 5
    assert embedded.data[0].embedding == pytest.approx(alone.data[0].embedding, abs=1e-4)
    assert_no_leak(cluster)


def test_minus_one_cuts_a_document_many_times_the_context_to_fit(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """A document far past the context (more characters than the head that refuses an uncut
    prompt unread) is cut to the context for an embedding, and to leave room for max_tokens
    for a completion."""
    links = cluster.service.links
    assert links.limits is not None
    context = links.limits.max_model_len
    long = PROMPT * (context // 2)  # 40 characters a position: past the 16 a head reads
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=MODEL, input=long)
    embedded = client.embeddings.create(
        model=MODEL, input=long, extra_body={"truncate_prompt_tokens": -1}
    )
    assert embedded.usage.prompt_tokens == context
    answered = client.completions.create(
        model=MODEL, prompt=long, max_tokens=3, extra_body={"truncate_prompt_tokens": -1}
    )
    assert answered.usage is not None
    assert answered.usage.prompt_tokens == context - 3
    cut = client.embeddings.create(
        model=MODEL, input=long, extra_body={"truncate_prompt_tokens": 6}
    )
    assert cut.usage.prompt_tokens == 6
    assert_no_leak(cluster)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must be -1 or at least 1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens: must be -1 or at least 1"),
        ({"truncate_prompt_tokens": 2**40}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 10**6}, "over the model's context length"),
        ({"truncate_prompt_tokens": 3, "echo": True}, "echo: not with truncate_prompt_tokens"),
    ],
)
def test_what_is_not_served_with_it_is_refused_by_name(
    client: openai.OpenAI, cluster: LocalCluster, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=named):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices
    assert_no_leak(cluster)


def test_a_suffix_or_images_are_not_cut(cluster: LocalCluster) -> None:
    """Below the HTTP face (the tiny model has no fill-in-the-middle tokens, which the suffix
    is refused for first): a cut would fall inside the suffix's form, or an image's tokens."""
    limits = cluster.service.request_limits()
    assert limits is not None
    message = serving_pb2.GenerateRequest(suffix="end", truncate_prompt_tokens=2)
    with pytest.raises(InvalidRequest, match="not served with a suffix"):
        truncated_prompt(message, [1, 2, 3], limits, [])
    message = serving_pb2.GenerateRequest(truncate_prompt_tokens=2)
    with pytest.raises(InvalidRequest, match="not served with images"):
        truncated_prompt(message, [1, 2, 3], limits, [object()])
    assert truncated_prompt(message, [1, 2, 3], limits, []) == [2, 3]
    assert truncated_prompt(message, [1, 2], limits, []) is None  # no longer: as it is
    assert truncated_prompt(serving_pb2.GenerateRequest(), [1, 2, 3], limits, []) is None
