"""`truncation: "auto"` on the Responses API, with the `openai` SDK over real HTTP on loopback
against a local cluster of two tiny-model workers (a 1,024-token context, a byte-level
vocabulary): a conversation continued past the context loses its oldest exchange and is
answered exactly as the conversation without it is; without "auto" it is refused; a last turn
alone over the context is refused either way."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.tool_fixtures import openai_client, served
from worker.loader import LoadedModel

BRIEF: dict[str, Any] = {
    "model": SERVED_NAME,
    "instructions": "Be brief.",
    "max_output_tokens": 6,
    "temperature": 0,
}
TURN = "Tell me about page {} of the radix tree. " + "x" * 250
"""About 290 tokens: three turns fit the context, four do not."""


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster)


def said(turn: int) -> dict[str, Any]:
    return {"role": "user", "content": TURN.format(turn)}


def test_a_chain_past_the_context_drops_its_oldest_exchange(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    responses: list[Any] = []
    for turn in range(3):
        previous = {"previous_response_id": responses[-1].id} if responses else {}
        responses.append(client.responses.create(input=[said(turn)], **BRIEF, **previous))
    conversation: list[Any] = []
    for turn, response in enumerate(responses):
        conversation += [said(turn), *[i.model_dump(exclude_none=True) for i in response.output]]
    with pytest.raises(openai.BadRequestError, match="maximum context length") as refused:
        client.responses.create(input=[said(3)], previous_response_id=responses[-1].id, **BRIEF)
    assert refused.value.code == "context_length_exceeded"
    cut = client.responses.create(
        input=[said(3)], previous_response_id=responses[-1].id, truncation="auto", **BRIEF
    )
    assert cut.truncation == "auto" and cut.usage is not None
    first_exchange = 1 + len(responses[0].output)  # the user turn and what answered it
    without = client.responses.create(
        input=[*conversation[first_exchange:], said(3)], store=False, **BRIEF
    )
    assert without.usage is not None
    assert (cut.usage.input_tokens, cut.output_text) == (
        without.usage.input_tokens,
        without.output_text,
    )
    assert cut.usage.input_tokens + 6 <= 1024
    listed = client.responses.input_items.list(cut.id)
    assert [i.content[0].text for i in listed] == [TURN.format(3)]  # type: ignore[union-attr]
    cluster.wait_idle()


def test_a_last_turn_alone_over_the_context_is_still_refused(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    for truncation in ("auto", "disabled"):
        with pytest.raises(openai.BadRequestError, match="maximum context length") as refused:
            client.responses.create(
                input=[said(0), said(1), {"role": "user", "content": "y" * 1100}],
                truncation=truncation,  # type: ignore[arg-type]
                **BRIEF,
            )
        assert refused.value.body["param"] == "input"  # type: ignore[index]
    cluster.wait_idle()
