"""`truncation: "auto"` on the Responses API, with the `openai` SDK over real HTTP on loopback
against a local cluster of two tiny-model workers (a 1,024-token context, a byte-level
vocabulary, so a turn's characters are about its tokens): a chain continued past the context is
cut with slack and answered exactly as the conversation without the dropped turns is; its
follow-up starts from the same cut and hits the cache the cut prompt left; an agent's single
task with a loop of calls past the context keeps the task and drops whole calls with their
outputs; what fits is never cut; and a conversation nothing can make fit is refused as
before."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest

from cluster.http.responses_truncation import SLACK, Truncation, cuts
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from worker.errors import ContextOverflow

CONTEXT, ANSWER = 1024, 6
BRIEF: dict[str, Any] = {
    "model": SERVED_NAME,
    "instructions": "Be brief.",
    "max_output_tokens": ANSWER,
    "temperature": 0,
}
TURN = "Tell me about page {} of the radix tree. " + "x" * 160
"""About 200 tokens with the template's markup: four turns and their answers fit the
context, five do not; the head and two turns fit three quarters of it, the head and three do
not."""


def said(turn: int) -> dict[str, Any]:
    return {"role": "user", "content": TURN.format(turn)}


def items(response: Any) -> list[dict[str, Any]]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_a_chain_past_the_context_is_cut_with_slack_and_its_follow_up_keeps_the_cut(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    chain: list[Any] = []
    for turn in range(4):
        previous = {"previous_response_id": chain[-1].id} if chain else {}
        chain.append(client.responses.create(input=[said(turn)], **BRIEF, **previous))
    with pytest.raises(openai.BadRequestError, match="maximum context length") as refused:
        client.responses.create(input=[said(4)], previous_response_id=chain[-1].id, **BRIEF)
    assert refused.value.code == "context_length_exceeded"
    cut = client.responses.create(
        input=[said(4)], previous_response_id=chain[-1].id, truncation="auto", **BRIEF
    )
    assert cut.truncation == "auto" and cut.usage is not None
    # kept: the instructions and the first exchange (the head), then turn 3 onwards; dropping
    # less (from turn 2) would be over three quarters of the room
    head = [said(0), *items(chain[0])]
    kept = [*head, said(3), *items(chain[3]), said(4)]
    whole = client.responses.create(input=kept, store=False, **BRIEF)
    assert whole.usage is not None
    assert (cut.usage.input_tokens, cut.output_text) == (
        whole.usage.input_tokens,
        whole.output_text,
    )
    assert cut.usage.input_tokens <= SLACK * (CONTEXT - ANSWER)
    longer = [*head, said(2), *items(chain[2]), *kept[len(head) :]]
    over = client.responses.create(input=longer, store=False, **BRIEF)
    assert over.usage is not None and over.usage.input_tokens > SLACK * (CONTEXT - ANSWER)
    listed = client.responses.input_items.list(cut.id)  # the store keeps what was sent
    assert [i.content[0].text for i in listed] == [TURN.format(4)]  # type: ignore[union-attr]

    follow = client.responses.create(
        input=[said(5)], previous_response_id=cut.id, truncation="auto", **BRIEF
    )
    assert follow.usage is not None
    again = client.responses.create(input=[*kept, *items(cut), said(5)], store=False, **BRIEF)
    assert again.usage is not None
    assert (follow.usage.input_tokens, follow.output_text) == (
        again.usage.input_tokens,
        again.output_text,
    )
    # it begins as the cut prompt did: that prompt is cached (pages of 4 positions)
    cached = follow.usage.input_tokens_details.cached_tokens
    assert cached >= cut.usage.input_tokens - 4
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(input=[said(5)], previous_response_id=cut.id, **BRIEF)
    # without the instructions the head is one turn shorter, and the cut the same turns
    bare = {key: value for key, value in BRIEF.items() if key != "instructions"}
    plain = client.responses.create(
        input=[said(5)], previous_response_id=cut.id, truncation="auto", **bare
    )
    sent = client.responses.create(input=[*kept, *items(cut), said(5)], store=False, **bare)
    assert plain.usage is not None and sent.usage is not None
    assert (plain.usage.input_tokens, plain.output_text) == (
        sent.usage.input_tokens,
        sent.output_text,
    )
    cluster.wait_idle()


def test_an_agents_task_stays_and_its_oldest_calls_go_with_their_outputs(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    task = {"role": "user", "content": "Find the page. " + "t" * 120}
    loop: list[dict[str, Any]] = []
    for step in range(7):
        call_id = f"call_{step}"
        loop.append(
            {"type": "function_call", "call_id": call_id, "name": "read", "arguments": "{}"}
        )
        loop.append(
            {"type": "function_call_output", "call_id": call_id, "output": f"{step} " + "o" * 150}
        )
    conversation = [task, *loop]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(input=conversation, store=False, **BRIEF)
    cut = client.responses.create(input=conversation, store=False, truncation="auto", **BRIEF)
    assert cut.usage is not None and cut.usage.input_tokens <= SLACK * (CONTEXT - ANSWER)
    head = [task, *loop[:2]]  # the task, its first call and that call's output
    for kept_steps in range(1, 7):  # the cut keeps whole steps: some last calls and outputs
        whole = client.responses.create(
            input=[*head, *loop[-2 * kept_steps :]], store=False, **BRIEF
        )
        assert whole.usage is not None
        if whole.usage.input_tokens == cut.usage.input_tokens:
            assert whole.output_text == cut.output_text
            break
    else:
        raise AssertionError("the cut prompt is no task with a run of its last steps")
    more = client.responses.create(
        input=[*head, *loop[-2 * (kept_steps + 1) :]], store=False, **BRIEF
    )
    assert more.usage is not None
    assert more.usage.input_tokens > SLACK * (CONTEXT - ANSWER)  # the first cut with slack
    cluster.wait_idle()


def test_what_fits_is_never_cut(client: openai.OpenAI) -> None:
    conversation = [said(0), said(1), said(2)]
    cut = client.responses.create(input=conversation, store=False, truncation="auto", **BRIEF)
    whole = client.responses.create(input=conversation, store=False, **BRIEF)
    assert cut.usage is not None and whole.usage is not None
    assert cut.usage.input_tokens == whole.usage.input_tokens


def test_a_conversation_nothing_makes_fit_is_still_refused(
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


def test_a_cut_call_is_counted_once_and_a_refusal_that_stands_once(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """Under radixmesh_router_requests{status}: the refusal a cut cures, and the prompts
    counted to find the cut, are no calls of their own; a refusal nothing cures is one."""
    turns: list[dict[str, Any]] = []
    for turn in range(5):
        turns += [said(turn), {"role": "assistant", "content": "Noted."}]
    conversation = [*turns, said(5)]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(input=conversation, store=False, **BRIEF)
    before = dict(cluster.service.counters.by_status)
    client.responses.create(input=conversation, store=False, truncation="auto", **BRIEF)
    assert gained(cluster, before) == {"OK": 1}
    before = dict(cluster.service.counters.by_status)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(
            input=[said(0), said(1), {"role": "user", "content": "y" * 1100}],
            store=False,
            truncation="auto",
            **BRIEF,
        )
    assert gained(cluster, before) == {"INVALID_ARGUMENT": 1}
    cluster.wait_idle()


def gained(cluster: LocalCluster, before: dict[str, int]) -> dict[str, int]:
    """What each status's count gained since `before`."""
    now = cluster.service.counters.by_status
    return {
        status: n - before.get(status, 0) for status, n in now.items() if n != before.get(status, 0)
    }


def test_cuts_fall_before_a_user_turn_or_the_step_after_a_tools_output() -> None:
    def turns(*roles: str) -> list[serving_pb2.ChatMessage]:
        return [serving_pb2.ChatMessage(role=role) for role in roles]

    # the head runs through the first exchange: the task, its call and the call's output
    loop = turns("system", "user", "assistant", "tool", "assistant", "tool", "user", "assistant")
    assert cuts(loop) == (4, [6])
    chat = turns("user", "assistant", "user", "assistant", "user")
    assert cuts(chat) == (2, [4])
    # a conversation that opens with a call keeps the call with its output
    assert cuts(turns("assistant", "tool", "assistant", "tool", "user")) == (2, [4])
    assert cuts(turns("user")) == (1, [])


def test_a_streamed_or_background_response_is_cut_as_a_plain_one(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    conversation = [said(k) for k in range(6)]  # over the context: cut
    plain = client.responses.create(input=conversation, store=False, truncation="auto", **BRIEF)
    assert plain.usage is not None
    events = client.responses.create(
        input=conversation, stream=True, store=False, truncation="auto", **BRIEF
    )
    ends = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    (streamed,) = ends
    assert streamed.usage is not None and streamed.status in ("completed", "incomplete")
    assert (streamed.usage.input_tokens, streamed.output_text) == (
        plain.usage.input_tokens,
        plain.output_text,
    )
    queued = client.responses.create(
        input=conversation, background=True, truncation="auto", **BRIEF
    )
    deadline = time.monotonic() + 60
    while (ended := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never ended"
        time.sleep(0.01)
    assert ended.status in ("completed", "incomplete") and ended.usage is not None
    assert ended.usage.input_tokens == plain.usage.input_tokens
    cluster.wait_idle()


def test_a_truncated_stream_dropped_mid_way_ends_its_call(
    cluster: LocalCluster,
) -> None:
    conversation = [said(k) for k in range(6)]
    body = {**BRIEF, "input": conversation, "truncation": "auto", "stream": True}
    body |= {"max_output_tokens": 200, "store": False}
    with (
        httpx.Client(base_url=cluster.http_url, timeout=60) as http,
        http.stream("POST", "/v1/responses", json=body) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass  # generating: then the client goes away
    deadline = time.monotonic() + 10
    while cluster.service.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not cluster.service.in_flight
    cluster.wait_idle()


def _message(*roles: str) -> serving_pb2.GenerateRequest:
    message = serving_pb2.GenerateRequest()
    message.chat.messages.extend(
        serving_pb2.ChatMessage(role=role, content=f"{role} {i}") for i, role in enumerate(roles)
    )
    return message


async def _counted(
    refusals: dict[int, grpc.StatusCode], sizes: list[int], trial: serving_pb2.GenerateRequest
) -> int:
    """A prompt's tokens by its turns' sizes (turn i's is sizes[i], named by its content), or
    the refusal given for its turn count."""
    turns = len(trial.chat.messages)
    if turns in refusals:
        raise ServingError(refusals[turns], "messages: refused")
    return sum(sizes[int(turn.content.split()[1])] for turn in trial.chat.messages)


@pytest.mark.parametrize(
    ("refusals", "expected"),
    [
        ({}, 4),  # every cut fits: the first
        ({8: grpc.StatusCode.INVALID_ARGUMENT}, 6),  # a template refuses the first: the next
    ],
)
def test_a_cut_the_core_refuses_for_another_reason_counts_as_one_that_does_not_fit(
    refusals: dict[int, grpc.StatusCode], expected: int
) -> None:
    chat = ["user", "assistant"] * 5  # head: the first exchange; cuts before turns 4, 6, 8
    truncation = Truncation(_message(*chat), [f"input[{i}]" for i in range(10)], reserve=0)
    assert (truncation.head, truncation.cuts) == (2, [4, 6, 8])
    count = functools.partial(_counted, refusals, [1] * 10)
    assert asyncio.run(truncation._cut(count, 100)) == expected
    # anything but a refusal of the request is no answer about the cut: it propagates
    broken = functools.partial(_counted, {8: grpc.StatusCode.UNAVAILABLE}, [1] * 10)
    with pytest.raises(ServingError):
        asyncio.run(truncation._cut(broken, 100))


def test_what_ends_the_search_for_a_cut_is_counted_once() -> None:
    """The first attempt's refusal for length is no call of its own; what stands instead, the
    refusal when nothing fits or a failure of counting, is counted by `refused`."""
    chat = ["user", "assistant"] * 5

    async def refused_for_length() -> Any:
        raise ServingError(
            grpc.StatusCode.INVALID_ARGUMENT, "prompt: too long", reason=ContextOverflow.reason
        )
        yield  # an async generator, as a stream is

    async def served(
        count: Any, max_model_len: int, counted: list[grpc.StatusCode]
    ) -> grpc.StatusCode:
        truncation = Truncation(_message(*chat), [f"input[{i}]" for i in range(10)], reserve=0)
        stream = truncation.serve(
            refused_for_length(),
            lambda cut: refused_for_length(),
            count,
            max_model_len,
            lambda err: counted.append(err.code),
        )
        with pytest.raises(ServingError) as failed:
            await anext(stream)
        return failed.value.code

    for refusals, room, code in (
        ({}, 1, grpc.StatusCode.INVALID_ARGUMENT),  # nothing fits: the refusal stands
        ({8: grpc.StatusCode.UNAVAILABLE}, 100, grpc.StatusCode.UNAVAILABLE),  # no worker left
    ):
        counted: list[grpc.StatusCode] = []
        count = functools.partial(_counted, refusals, [1] * 10)
        assert asyncio.run(served(count, room, counted)) == code
        assert counted == [code]


def test_a_conversation_past_the_context_keeps_its_cut_turn_after_turn(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """As a chain does: the cut of a conversation's response is kept with the conversation,
    so the next turn starts from it and reads the cut prompt from the cache."""
    talk = client.conversations.create()
    for turn in range(4):
        client.responses.create(input=[said(turn)], conversation=talk.id, **BRIEF)
    cut = client.responses.create(input=[said(4)], conversation=talk.id, truncation="auto", **BRIEF)
    assert cut.usage is not None and cut.usage.input_tokens <= SLACK * (CONTEXT - ANSWER)
    cluster.wait_idle()
    follow = client.responses.create(
        input=[said(5)], conversation=talk.id, truncation="auto", **BRIEF
    )
    assert follow.usage is not None
    assert follow.usage.input_tokens_details.cached_tokens >= cut.usage.input_tokens - 4
    cluster.wait_idle()
