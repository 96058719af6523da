"""The OpenAI API on the router, driven by the official `openai` SDK over real HTTP on loopback,
against a local cluster of two tiny-model workers: what the SDK gets is what vLLM's users get."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest

from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MODEL = SERVED_NAME
CHAT = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny, http=True)
    yield cluster
    cluster.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def assert_no_leak(cluster: LocalCluster, within_s: float = 20) -> None:
    """Every request ended on every worker and every page is back (free or cached)."""
    cluster.wait_idle(within_s)
    assert not cluster.service.in_flight


def test_chat_completion_has_openai_shape_and_cached_tokens(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0
    )
    assert first.object == "chat.completion" and first.model == MODEL
    assert first.id.startswith("chatcmpl-")
    (choice,) = first.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = first.usage
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content == choice.message.content  # greedy
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt hit the cache
    assert_no_leak(cluster)
