"""The Responses API's logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs`):
the answer's tokens with their logprobs on its `output_text`, the same as chat completions give
for the same chat, whole and streamed (each text delta with its tokens'); none unless included;
a thinking model's reasoning tokens left out (on a made-up stream: the tiny thinking model
never closes its reasoning); a function call's tokens left out of the message's (made-up
streams too: the tiny model writes a call only when made to, and then nothing else). Real HTTP
on loopback with the `openai` SDK."""

from __future__ import annotations

import time
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.http import responses_output
from cluster.http.openai_responses import Sample
from cluster.http.token_texts import TokenTexts
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.test_http_responses import TOOLS
from tests.cluster.test_http_responses_reasoning import run_events

MODEL = SERVED_NAME
QUESTION = "the quick brown fox"
LOGPROBS = ["message.output_text.logprobs"]
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}


def listed(entries: Any) -> list[tuple[str, float, list[str]]]:
    """(token, logprob rounded, the top tokens) of each entry, SDK objects or dicts."""
    out = []
    for entry in entries:
        e = entry if isinstance(entry, dict) else entry.model_dump()
        out.append((e["token"], round(e["logprob"], 3), [t["token"] for t in e["top_logprobs"]]))
    return out


def chat_logprobs(client: openai.OpenAI) -> list[tuple[str, float, list[str]]]:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
    )
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    return listed(logprobs.content)


def test_the_answer_has_the_logprobs_chat_gives(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    expected = chat_logprobs(client)
    reply = client.responses.create(
        input=QUESTION,
        include=LOGPROBS,  # type: ignore[list-item]
        top_logprobs=3,
        **GREEDY,
    )
    (message,) = reply.output
    assert message.type == "message"
    (part,) = message.content
    assert part.type == "output_text"
    assert listed(part.logprobs) == expected
    assert reply.usage is not None and len(expected) == reply.usage.output_tokens
    assert all(len(top) == 3 for _, _, top in expected) and reply.top_logprobs == 3
    assert cluster.http is not None
    kept = cluster.http.api.responses.get("", reply.id)  # the conversation a follow-up reads
    assert kept is not None and b'"logprobs": []' in kept.conversation[-1]
    assert b'"logprobs":[{' in kept.response  # the response object keeps them
    plain = client.responses.create(input=QUESTION, top_logprobs=3, **GREEDY)
    (part,) = plain.output[0].content  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs == []  # not included: none
    cluster.wait_idle()


def test_the_stream_carries_each_deltas_logprobs(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    expected = chat_logprobs(client)
    deltas, done, final = [], None, None
    stream = client.responses.create(
        input=QUESTION,
        include=LOGPROBS,  # type: ignore[list-item]
        top_logprobs=3,
        stream=True,
        **GREEDY,
    )
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas += listed(event.logprobs)
        elif event.type == "response.output_text.done":
            done = listed(event.logprobs)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert done == expected and final is not None
    assert deltas == expected[: len(deltas)] and len(deltas) >= len(expected) - 2  # held: a stop
    part = final.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and listed(part.logprobs) == expected
    cluster.wait_idle()


def test_a_background_response_has_them_too(client: openai.OpenAI, cluster: LocalCluster) -> None:
    expected = chat_logprobs(client)
    queued = client.responses.create(
        input=QUESTION,
        include=LOGPROBS,  # type: ignore[list-item]
        top_logprobs=3,
        background=True,
        **GREEDY,
    )
    deadline = time.monotonic() + 30
    kept = client.responses.retrieve(queued.id)
    while kept.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        kept = client.responses.retrieve(queued.id)
    part = kept.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and listed(part.logprobs) == expected
    cluster.wait_idle()


TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def test_tools_not_called_leave_the_logprobs(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """With tool_choice "none" no call is read out of the text: its tokens are the message's."""
    reply = client.responses.create(
        input=QUESTION,
        include=LOGPROBS,  # type: ignore[list-item]
        top_logprobs=3,
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice="none",
        **GREEDY,
    )
    part = reply.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and reply.usage is not None
    assert len(part.logprobs) == reply.usage.output_tokens > 0
    cluster.wait_idle()


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"include": ["message.nope"]}, "include[0]", "can be included"),
    ],
)
def test_refusals_name_the_field(
    cluster: LocalCluster, change: dict[str, Any], param: str, words: str
) -> None:
    body = {**GREEDY, "input": QUESTION} | change
    answer = httpx.post(f"{cluster.http_url}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    cluster.wait_idle()


NONE: frozenset[str] = frozenset()
Chunk = tuple[str, str, list[int], int]
"""A made-up message: reasoning text, text, token ids, how many of its tokens were reasoning."""


def made_up(chunks: list[Chunk]) -> list[serving_pb2.GenerateResponse]:
    responses = []
    for reasoning, text, ids, thought in chunks:
        message = serving_pb2.GenerateResponse(
            index=0, reasoning_text=reasoning, text=text, token_ids=ids,
            reasoning_tokens=thought, worker="w",
        )  # fmt: skip
        for token in ids:
            message.logprobs.add(logprob=-token / 10, top_ids=[token], top_logprobs=[-token / 10])
        responses.append(message)
    responses[-1].finished, responses[-1].finish_reason = True, "stop"
    return responses


def streamed(
    responses: list[serving_pb2.GenerateResponse],
    tools: frozenset[str] = NONE,
    texts: TokenTexts | None = None,
) -> list[dict[str, Any]]:
    """The events of the made-up stream, with logprobs asked for (token k reads "token_id:k",
    unless `texts` says)."""
    return run_events(responses, tools, texts or TokenTexts(None))


def tokens_of(events: list[dict[str, Any]]) -> tuple[list[list[str]], list[str], list[str]]:
    """Each text delta's logprob tokens, the done event's, and the final response's."""
    deltas = [
        [t["token"] for t in e["logprobs"]]
        for e in events
        if e["type"] == "response.output_text.delta"
    ]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    (message,) = [i for i in events[-1]["response"]["output"] if i["type"] == "message"]
    final = [t["token"] for t in message["content"][0]["logprobs"]]
    return deltas, [t["token"] for t in done["logprobs"]], final


def whole(
    responses: list[serving_pb2.GenerateResponse],
    tools: frozenset[str] = NONE,
    texts: TokenTexts | None = None,
) -> list[str]:
    """The non-streamed reading: the sample's tokens after its reasoning's, less its calls'."""
    sample = Sample()
    for message in responses:
        sample.take(message)
    read = responses_output.message_logprobs(texts or TokenTexts(None), sample, tools)
    return [t.token for t in read]


class Vocabulary:
    """A decoder of made-up token ids, each its own text."""

    def __init__(self, table: dict[int, str]) -> None:
        self.table = table

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.table[i] for i in ids)


def test_a_thinking_models_reasoning_tokens_are_left_out() -> None:
    """Reasoning, then reasoning and answer in one message, then answer: each text delta
    carries the logprobs of the answer's tokens it brings, as the whole response has them."""
    chunks = [("it ", "", [1, 2], 2), ("rains", "\n\nPa", [3, 4, 5], 1), ("", "ris", [6], 0)]
    responses = made_up(chunks)
    answer = ["token_id:4", "token_id:5", "token_id:6"]
    deltas, done, final = tokens_of(streamed(responses))
    assert deltas == [["token_id:4", "token_id:5"], ["token_id:6"]]
    assert done == final == whole(responses) == answer
    event = streamed(responses)[-1]["response"]["output"][1]["content"][0]["logprobs"][0]
    assert round(event["logprob"], 6) == -0.4 and event["bytes"] == list(b"token_id:4")


def test_a_held_token_that_opens_the_reasoning_is_the_reasonings() -> None:
    """A token whose text was held (a newline before `<think>`) and that the next message
    counts as reasoning (its count takes in the held token) is not the answer's."""
    chunks = [("", "", [1], 0), ("", "", [2], 2), ("hmm", "", [3], 1), ("", "", [4], 1)]
    responses = made_up([*chunks, ("", "Hi", [5], 0)])
    deltas, done, final = tokens_of(streamed(responses))
    assert deltas == [["token_id:5"]] and done == final == whole(responses) == ["token_id:5"]


def test_a_held_stop_strings_tokens_end_in_the_done_event() -> None:
    """Tokens whose text never came (a stop string, cut from the text) are the answer's all
    the same: in the done event and the response, not in a delta."""
    responses = made_up([("", "Par", [1, 2], 0), ("", "", [3], 0)])
    deltas, done, final = tokens_of(streamed(responses))
    assert deltas == [["token_id:1", "token_id:2"]]
    assert done == final == whole(responses) == ["token_id:1", "token_id:2", "token_id:3"]


CALL = ["<tool_call>", '\n{"name": "f", "arguments": {"a": 1}}', "\n</tool_call>"]
"""A call of `f`, over three messages."""


def one_a_token(texts: list[str]) -> list[serving_pb2.GenerateResponse]:
    """A made-up stream of a message a text, token k + 1 the k-th, and an end token."""
    return made_up([("", text, [k + 1], 0) for k, text in enumerate([*texts, ""])])


def message_and_calls(events: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The final response's items' types, and the call's arguments events' texts."""
    output = events[-1]["response"]["output"]
    arguments = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
    return [item["type"] for item in output], arguments


def test_a_calls_tokens_are_not_the_messages() -> None:
    """Text, then a token running into the call's tag (" <": the content's, as its text starts
    there), then the call, then more text, then the end token: the message has the logprobs of
    all but the call's three tokens, streamed (each delta its own) as whole."""
    responses = one_a_token(["Hi", " <", "tool_call>", *CALL[1:], " Bye"])
    events = streamed(responses, frozenset({"f"}))
    deltas, done, final = tokens_of(events)
    answer = ["token_id:1", "token_id:2", "token_id:6", "token_id:7"]
    assert deltas == [["token_id:1"], ["token_id:2"], ["token_id:6", "token_id:7"]]
    assert done == final == whole(responses, frozenset({"f"})) == answer
    assert message_and_calls(events) == (["message", "function_call"], ['{"a": 1}'])
    (message,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert message["text"] == "Hi  Bye"


def test_a_token_held_as_a_calls_tag_waits() -> None:
    """A message whose last token may begin a call's tag: its text is let out but for that
    token's, and so are the logprobs; the token turns out to be the call's."""
    tag = CALL[0].removeprefix("<")
    responses = made_up(
        [("", "Hi<", [1, 2], 0), ("", tag, [3], 0), ("", "".join(CALL[1:]), [4], 0)]
    )
    deltas, done, final = tokens_of(streamed(responses, frozenset({"f"})))
    assert deltas == [["token_id:1"]] and done == final == ["token_id:1"]
    assert whole(responses, frozenset({"f"})) == done


def test_calls_alone_have_no_message_and_no_logprobs() -> None:
    responses = one_a_token(["\n", *CALL, *CALL])
    events = streamed(responses, frozenset({"f"}))
    assert message_and_calls(events) == (["function_call", "function_call"], ['{"a": 1}'] * 2)
    assert not [e for e in events if "logprobs" in e]
    assert whole(responses, frozenset({"f"})) == ["token_id:1", "token_id:8"]  # no message: unread


def test_a_tag_that_is_no_call_is_the_messages() -> None:
    """A tag around a function not offered stays in the content, its tokens' logprobs too."""
    responses = one_a_token(["Hi ", *CALL])
    deltas, done, final = tokens_of(streamed(responses, frozenset({"g"})))
    assert (
        done
        == final
        == whole(responses, frozenset({"g"}))
        == [f"token_id:{k}" for k in range(1, 6)]
    )
    assert [t for d in deltas for t in d] == done


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_answers_with_logprobs_asked(
    client: openai.OpenAI, cluster: LocalCluster, stream: bool
) -> None:
    """Asking for the message's logprobs with tools is served: a required call alone, as without
    logprobs, and no message to carry any."""
    body: dict[str, Any] = {
        "input": "What is the weather in Oslo?",
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        **GREEDY,
        "max_output_tokens": 150,
    }
    plain = client.responses.create(**body)
    if stream:
        with client.responses.stream(**body, include=LOGPROBS, top_logprobs=2) as events:
            asked = events.get_final_response()
    else:
        asked = client.responses.create(**body, include=LOGPROBS, top_logprobs=2)
    assert (
        [item.type for item in asked.output]
        == ["function_call"]
        == [item.type for item in plain.output]
    )
    assert asked.output[0].arguments == plain.output[0].arguments  # type: ignore[union-attr]
    cluster.wait_idle()


@pytest.mark.parametrize("newline", [False, True])
def test_tokens_are_placed_by_their_own_texts_around_a_call(newline: bool) -> None:
    """Token texts as a tokenizer gives them: a message holding a reasoning token (no text of
    the answer's) and answer tokens, then the call right after them, or after a newline held
    (as before a possible `<think>`) and let out with the call's tag; text after the call. The
    message has the answer's tokens, the newline, and those after the call; the tag's token,
    which starts after the newline, is the call's."""
    body = '\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    table = {1: "it", 2: " rains", 3: "</think>", 4: "\n\nPa", 5: "ris", 6: "\n"}
    table |= {7: "<tool_call>", 8: body, 9: " Bye", 10: "<|im_end|>"}
    texts = TokenTexts(Vocabulary(table))
    chunks = [("it rains", "", [1, 2], 2), ("", "\n\nParis", [3, 4, 5], 1)]
    if newline:
        chunks += [("", "", [6], 0), ("", "\n<tool_call>", [7], 0)]
    else:
        chunks += [("", "<tool_call>", [7], 0)]
    chunks += [("", body, [8], 0), ("", " Bye", [9], 0), ("", "", [10], 0)]
    responses = made_up(chunks)
    tools = frozenset({"f"})
    answer = ["\n\nPa", "ris", *(["\n"] if newline else []), " Bye", "<|im_end|>"]
    _, done, final = tokens_of(streamed(responses, tools, texts))
    assert done == final == whole(responses, tools, texts) == answer
