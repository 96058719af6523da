"""A thinking model's reasoning over the OpenAI chat API, with the `openai` SDK: apart from the
answer in `reasoning_content` (and `reasoning`), streamed or whole, written back into the next
turn, and left in the text when a request asks (`separate_reasoning: false`). The tiny model is
made to write the tags by a structured choice."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2 as httpx
import openai
import pytest

from cluster.loadtest.openai_api import _Events
from cluster.loadtest.records import RequestRecord
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster

QUESTION = [{"role": "user", "content": "Which city?"}]


@pytest.fixture(scope="module")
def cluster(thinking_cluster: LocalCluster) -> LocalCluster:
    return thinking_cluster


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def forced(text: str, **more: Any) -> dict[str, Any]:
    return {"guided_choice": [text], **more}


def test_the_reasoning_comes_apart_from_the_answer(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0,
        extra_body=forced("it rains</think>\n\nParis"),
    )  # fmt: skip
    message = reply.choices[0].message
    assert message.content == "\n\nParis"
    assert message.model_extra is not None
    assert (
        message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == "it rains"
    )
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_the_deltas_add_up_to_the_same(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, stream=True,
        extra_body=forced("it rains</think>\n\nParis"),
    )  # fmt: skip
    reasoning, content, chunks = "", "", 0
    for chunk in stream:
        chunks += 1
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("it rains", "\n\nParis")
    assert chunks > 3  # streamed, not one chunk at the end


def test_thinking_switched_off_by_the_template(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0,
        extra_body=forced("Paris", chat_template_kwargs={"enable_thinking": False}),
    )  # fmt: skip
    message = reply.choices[0].message
    assert message.content == "Paris"
    assert (message.model_extra or {}).get("reasoning_content") is None


def test_include_reasoning_false_leaves_it_out_whole_or_streamed(client: openai.OpenAI) -> None:
    """vLLM's `include_reasoning: false`: the answer alone, the reasoning still counted."""
    ask = forced("it rains</think>\n\nParis", include_reasoning=False)
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, extra_body=ask
    )
    message = reply.choices[0].message
    assert message.content == "\n\nParis"
    assert (message.model_extra or {}).get("reasoning_content") is None
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, stream=True, extra_body=ask
    )
    deltas = [chunk.choices[0].delta for chunk in stream]
    assert "".join(d.content or "" for d in deltas) == "\n\nParis"
    assert not any((d.model_extra or {}).get("reasoning_content") for d in deltas)


def test_asked_not_to_separate_the_text_is_whole(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0,
        extra_body=forced("it rains</think>Paris", separate_reasoning=False),
    )  # fmt: skip
    assert reply.choices[0].message.content == "it rains</think>Paris"


def test_the_answer_sent_back_with_its_reasoning_is_the_next_turn(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """A client that appends the SDK's message as it came (reasoning fields and all) is served;
    an assistant's reasoning reaches the template, anyone else's is refused by name."""
    first = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, extra_body=forced("r</think>Paris")
    )
    turn = first.choices[0].message.model_dump(exclude_none=True)
    assert turn["reasoning_content"] == "r"
    follow = [*QUESTION, turn, {"role": "user", "content": "Why?"}]
    second = client.chat.completions.create(
        model=SERVED_NAME, messages=follow, temperature=0.0, extra_body=forced("x</think>Rain")
    )
    assert second.choices[0].message.content == "Rain"
    rendered = httpx.post(
        f"{cluster.http_url}/tokenize", json={"model": SERVED_NAME, "messages": follow}
    ).json()["tokens"]
    text = httpx.post(
        f"{cluster.http_url}/detokenize", json={"model": SERVED_NAME, "tokens": rendered}
    ).json()["prompt"]
    assert "assistant\n<think>\nr\n</think>\n\nParis\nuser\nWhy?" in text  # specials skipped
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.reasoning_content"):
        client.chat.completions.create(
            model=SERVED_NAME,
            messages=[{**QUESTION[0], "reasoning_content": "no"}],  # type: ignore[list-item]
            max_tokens=1,
        )


def test_the_messages_api_answers_without_the_reasoning_unless_asked(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """Anthropic's API shows thinking only when asked (tests/cluster/
    test_http_anthropic_thinking.py), and OpenAI's Responses API keeps the reasoning out of
    the answer's text (a reasoning item holds it: test_http_responses_reasoning.py): both
    answer with what follows `</think>`. Here the model is cut while still thinking, so the
    answer is empty, though the chat API shows the same tokens as reasoning."""
    whole = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, max_tokens=6,
        extra_body={"separate_reasoning": False},
    )  # fmt: skip
    split = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, max_tokens=6
    )
    thought = (split.choices[0].message.model_extra or {}).get("reasoning_content")
    assert whole.choices[0].message.content and thought == whole.choices[0].message.content
    assert split.choices[0].message.content == ""
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="x", max_retries=0) as claude:
        reply = claude.messages.create(
            model=SERVED_NAME, max_tokens=6, messages=QUESTION,  # type: ignore[arg-type]
            extra_body={"temperature": 0.0},
        )  # fmt: skip
        assert [(b.type, getattr(b, "text", None)) for b in reply.content] == [("text", "")]
        assert reply.stop_reason == "max_tokens"
        with claude.messages.stream(
            model=SERVED_NAME, max_tokens=6, messages=QUESTION,  # type: ignore[arg-type]
            extra_body={"temperature": 0.0},
        ) as stream:  # fmt: skip
            assert "".join(stream.text_stream) == ""
    response = client.responses.create(
        model=SERVED_NAME, input="Which city?", max_output_tokens=6, temperature=0.0
    )
    assert response.output_text == ""


NO_ARGUMENTS = {"type": "object", "properties": {}}


def test_a_constrained_answer_comes_after_the_reasoning_the_prompt_opened(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """A required call, or JSON, waits for the reasoning to end (vLLM's way): with a budget
    closing it, the model reasons, then calls, on every API; a prompt whose thinking is off
    gets its JSON from the first token."""
    tool = {"type": "function", "function": {"name": "city", "parameters": NO_ARGUMENTS}}
    reply = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, temperature=0.0, max_tokens=96,
        tools=[tool], tool_choice="required", parallel_tool_calls=False,  # type: ignore[list-item]
        extra_body={"thinking_token_budget": 4},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert choice.message.tool_calls[0].function.name == "city"  # type: ignore[union-attr]
    assert (choice.message.model_extra or {}).get("reasoning_content")
    with anthropic.Anthropic(base_url=cluster.http_url, api_key="x", max_retries=0) as claude:
        message = claude.messages.create(
            model=SERVED_NAME, max_tokens=96, messages=QUESTION,  # type: ignore[arg-type]
            tools=[{"name": "city", "input_schema": NO_ARGUMENTS}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            thinking={"type": "enabled", "budget_tokens": 4}, extra_body={"temperature": 0.0},
        )  # fmt: skip
        assert [block.type for block in message.content] == ["thinking", "tool_use"]
    response = client.responses.create(
        model=SERVED_NAME, input="Which city?", max_output_tokens=8, temperature=0.0,
        text={"format": {"type": "json_object"}}, reasoning={"effort": "none"},
    )  # fmt: skip
    assert response.output_text.startswith("{")
    assert [item.type for item in response.output] == ["message"]


def test_the_load_generator_counts_a_thinking_models_reasoning_as_its_tokens(
    cluster: LocalCluster,
) -> None:
    """The harness's reading of a real stream: its first token is the reasoning's first, and
    every message counts, not only those that carry answer text."""
    record = RequestRecord(0, 0, "r", "", "", 0.0)
    events = _Events(record, chat=True)
    body = {
        "model": SERVED_NAME, "messages": QUESTION, "max_tokens": 6, "temperature": 0.0,
        "stream": True,
    }  # fmt: skip
    with httpx.stream("POST", f"{cluster.http_url}/v1/chat/completions", json=body) as reply:
        for at, line in enumerate(reply.iter_lines()):
            if line.startswith("data: ") and not events.feed(line.removeprefix("data: "), at):
                break
    assert "".join(events.parts) == ""  # cut while thinking: no answer text
    assert record.first_token is not None and len(record.token_times) > 2  # not the end alone
    assert record.first_token < record.token_times[-1]
