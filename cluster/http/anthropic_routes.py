"""POST /v1/messages (Anthropic's Messages API, text and image content, streamed or not) and
/v1/messages/count_tokens (text and images), over the same serving core as everything else.

Image blocks carry base64 files (cluster/http/image_parts.py); each goes to
GenerateRequest.images, placed by a ChatPart where it was, and is named by its block when
refused ("messages[0].content[1].source").

Thinking (cluster/http/anthropic_thinking.py): `thinking` asks a thinking model for its
reasoning as a `thinking` block before the answer (closed at `budget_tokens`), or asks it not to
think; `thinking` blocks of an assistant turn are its reasoning for the template.

Tools: `tools` and `tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`) map to
the serving core's, `tool_use` blocks of an assistant turn to its calls and `tool_result` blocks
to tool messages (before the rest of their user turn); the calls come back as `tool_use` blocks
(worker/tool_calls.py reads them out of the text), streamed whole after the text.

finish reasons: a stop sequence -> stop_reason "stop_sequence" (and which, in stop_sequence),
any other stop -> "end_turn" ("tool_use" with calls), "length" -> "max_tokens". Usage counts
prompt tokens read from the prefix cache as `cache_read_input_tokens` and the rest as
`input_tokens`, as Anthropic does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cluster.http.anthropic_schema import (
    REFUSED,
    CountTokensRequest,
    Message,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    ThinkingBlock,
    TokenCount,
    ToolUseBlock,
)
from cluster.http.anthropic_thinking import Thinking, read_thinking, signature
from cluster.http.errors import GenerationFailed, HttpError, Renames, renames
from cluster.http.image_parts import anthropic_image
from cluster.http.openai_params import ChatPrompt, refuse_unsupported, set_priority, wire_tool
from cluster.http.openai_responses import (
    Counts,
    HeldCalls,
    Responses,
    collect,
    prepend,
    read,
    served_by,
)
from cluster.http.sse import EventStream
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from worker.request import FINISH_ABORT
from worker.tool_calls import ToolCall, read_calls

if TYPE_CHECKING:
    from cluster.http.app import HttpApi

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def aborted() -> HttpError:
    """What an aborted generation answers: an error, as none of Anthropic's stop reasons says
    it (a streamed one: an `error` event; a Message Batch's request: `errored`). A new one each
    time: an exception raised again keeps every earlier raise's frames."""
    return HttpError(499, "the generation was aborted (an Abort of its id, or its worker stopping)")


TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's tool_choice types -> the serving core's ("tool" names the function)."""


def add_routes(app: FastAPI, api: HttpApi) -> None:
    async def messages(body: MessagesRequest, request: Request) -> Response:
        caller = api.caller(request)
        adapter = api.check_model(body.model)
        rid = api.request_id(request)
        message, image_fields = generate_request(body, rid, api.tenant(request))
        message.namespace.adapter = adapter or ""
        model = adapter or api.model
        tools = callable_tools(body)
        fields = refusal_names(body)
        thinking = read_thinking(body.thinking, body.max_tokens)
        stream = api.start(message, caller, image_fields=image_fields)
        if body.stream:
            first = await api.finish(request, anext(stream), fields)  # a refusal: a status
            reply_events = events(f"msg_{rid}", model, first, stream, tools, thinking)
            return EventStream(reply_events, served_by(first))
        samples, counts = await api.finish(request, collect(stream), fields)
        sample = samples[0]
        if sample.finish_reason == FINISH_ABORT:  # Anthropic has no stop reason for it
            raise aborted()
        text = "".join(sample.text)
        content, calls = read_calls(text, tools) if tools else (text, [])
        blocks: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
        thought = "".join(sample.reasoning)
        if thinking.shown and thought:
            shown = "" if thinking.omitted else thought
            blocks.append(ThinkingBlock(thinking=shown, signature=signature(thought)))
        blocks += [TextBlock(text=content)] if content else []
        blocks += [tool_use(call) for call in calls]
        reply = Message(
            id=f"msg_{rid}",
            model=model,
            content=blocks or [TextBlock(text=text)],
            stop_reason=stop_reason(sample.finish_reason, sample.stop_string, calls),
            stop_sequence=sample.stop_string,
            usage=usage(counts),
        )
        return JSONResponse(reply.model_dump(), headers=counts.served_by())

    async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
        caller = api.caller(request)
        api.check_model(body.model)
        thinking = read_thinking(body.thinking)
        chat = chat_prompt(body)
        tools = request_tools(body)
        turns = any(m.tool_calls or m.role == "tool" or m.reasoning_content for m in chat.messages)
        prefill = ends_with_prefill(body)
        asks = thinking.enable is not None
        if chat.images or tools or turns or prefill or asks:  # written as when served
            ids = await api.chat_prompt_ids(
                chat, caller, api.tenant(request), tools, refusal_names(body), prefill,
                thinking.template_kwargs(),
            )  # fmt: skip
            return TokenCount(input_tokens=len(ids))
        text = await api.render(chat.messages)
        return TokenCount(input_tokens=len(await api.encode(text, False, "messages")))

    app.add_api_route("/v1/messages", messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])


def generate_request(
    body: MessagesRequest, request_id: str, tenant: str
) -> tuple[serving_pb2.GenerateRequest, list[str]]:
    """The request, and what its images are called in refusals."""
    refuse_unsupported(body, REFUSED)
    # a thinking model's reasoning comes apart from the answer: a `thinking` block when the
    # request enables thinking, else left out (cluster/http/anthropic_thinking.py)
    sampling = serving_pb2.SamplingParams(stop=body.stop_sequences or [], separate_reasoning=True)
    if not 1 <= body.max_tokens <= 2**31 - 1:
        raise HttpError.invalid("max_tokens", f"must be in [1, 2**31 - 1], got {body.max_tokens}")
    sampling.max_tokens = body.max_tokens
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise HttpError.invalid("temperature", f"must be in [0, 1], got {body.temperature}")
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(body, name)
        if value is not None:
            if name == "top_k" and not 0 <= value <= 2**31 - 1:
                raise HttpError.invalid("top_k", f"must be >= 0, got {value}")
            setattr(sampling, name, value)
    chat = chat_prompt(body)
    message = serving_pb2.GenerateRequest(
        request_id=request_id,
        chat=serving_pb2.ChatMessages(messages=chat.messages),
        sampling=sampling,
        images=chat.images,
        tools=request_tools(body),
        continue_final_message=ends_with_prefill(body),
    )
    set_priority(message, body.priority)
    read_thinking(body.thinking, body.max_tokens).apply(message)
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise HttpError.invalid("tool_choice.name", 'is required with type "tool"')
            message.tool_choice = choice.name
        else:
            message.tool_choice = TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use is not None:
            message.parallel_tool_calls = not choice.disable_parallel_tool_use
    message.namespace.tenant = tenant
    return message, chat.image_fields


def ends_with_prefill(body: MessagesRequest | CountTokensRequest) -> bool:
    """A last message of the assistant's with text and no `tool_use` is the start of the
    reply, which the model continues (Anthropic's prefill); one that calls tools is a closed
    turn, answered in a new one."""
    if not body.messages or body.messages[-1].role != "assistant":
        return False
    content = body.messages[-1].content
    if isinstance(content, str):
        return bool(content.strip())
    texts = [b.get("text") for b in content if b.get("type") == "text"]
    calls = any(b.get("type") == "tool_use" for b in content)
    return not calls and any(isinstance(t, str) and t.strip() for t in texts)


def refusal_names(body: MessagesRequest | CountTokensRequest) -> Renames:
    """The Messages API's names of the fields the serving core may refuse."""
    fields = {
        "sampling.structured.structural_tag": "tools",
        "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
        "stop": "stop_sequences",
    }
    if body.tool_choice is not None and body.tool_choice.type == "tool":
        fields["tool_choice"] = "tool_choice.name"  # the tool it names
    patterns = [
        (r"tools\[(\d+)\]\.parameters", r"tools[\1].input_schema"),
        (r"stop\[(\d+)\]", r"stop_sequences[\1]"),
    ]
    return renames(fields, patterns)


def request_tools(body: MessagesRequest | CountTokensRequest) -> list[serving_pb2.Tool]:
    return [wire_tool(tool.name, tool.description, tool.input_schema) for tool in body.tools or []]


def callable_tools(body: MessagesRequest) -> frozenset[str]:
    """The tools whose calls are read out of the answer (none with tool_choice none)."""
    if not body.tools or (body.tool_choice is not None and body.tool_choice.type == "none"):
        return frozenset()
    return frozenset(tool.name for tool in body.tools)


def tool_use(call: ToolCall) -> ToolUseBlock:
    tool_id = "toolu_" + call.id.removeprefix("call_")
    return ToolUseBlock(id=tool_id, name=call.name, input=json.loads(call.arguments))


def chat_prompt(body: MessagesRequest | CountTokensRequest) -> ChatPrompt:
    chat = ChatPrompt()
    if body.system is not None:
        system = _message("system", body.system, "system", chat)
        if system.parts:
            raise HttpError.invalid("system", "images go in the messages, not the system prompt")
        chat.messages.append(system)
    for i, each in enumerate(body.messages):
        where = f"messages[{i}].content"
        content = each.content
        if isinstance(content, list):  # each helper takes its own blocks, named where they are
            chat.messages += _tool_results(each.role, content, where)
            if each.role == "user" and all(b.get("type") == "tool_result" for b in content):
                continue  # a turn of tool results only
        calls = _tool_uses(each.role, content, where)
        reasoning = _thoughts(each.role, content, where)
        turn = _message(each.role, content, where, chat, skip=_NOT_TEXT)
        turn.tool_calls.extend(calls)
        turn.reasoning_content = reasoning
        chat.messages.append(turn)
    return chat


_NOT_TEXT = ("tool_use", "tool_result", "thinking", "redacted_thinking")
"""Blocks that are not a turn's text (their helpers read them)."""


def _thoughts(role: str, content: str | list[dict[str, Any]], where: str) -> str:
    """An assistant turn's `thinking` blocks, joined: its reasoning, which the template may
    write back (`reasoning_content`, as the chat API takes it). `redacted_thinking` blocks
    hold nothing radixmesh can read and are left out."""
    if isinstance(content, str):
        return ""
    thoughts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind not in ("thinking", "redacted_thinking"):
            continue
        if role != "assistant":
            raise HttpError.invalid(f"{where}[{j}]", f"{kind} blocks come in an assistant turn")
        if kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise HttpError.invalid(f"{where}[{j}].thinking", "must be a string")
            thoughts.append(block["thinking"])
    return "\n".join(thoughts)


def _tool_results(
    role: str, blocks: list[dict[str, Any]], where: str
) -> list[serving_pb2.ChatMessage]:
    """A user turn's `tool_result` blocks as tool messages (they come first in the turn)."""
    out = []
    for j, block in enumerate(blocks):
        if block.get("type") != "tool_result":
            continue
        if role != "user":
            raise HttpError.invalid(f"{where}[{j}]", "tool results come in a user turn")
        tool_id, content = block.get("tool_use_id"), block.get("content", "")
        if not isinstance(tool_id, str) or not tool_id:
            raise HttpError.invalid(f"{where}[{j}].tool_use_id", "is required")
        if isinstance(content, list):
            texts = [b.get("text") for b in content if isinstance(b, dict)]
            if not all(isinstance(t, str) for t in texts) or len(texts) != len(content):
                raise HttpError.invalid(
                    f"{where}[{j}].content", "only text blocks are served in a tool result"
                )
            content = "\n".join(texts)  # type: ignore[arg-type]
        if not isinstance(content, str):
            raise HttpError.invalid(f"{where}[{j}].content", "must be a string or text blocks")
        if block.get("is_error"):
            content = f"Error: {content}"
        out.append(serving_pb2.ChatMessage(role="tool", content=content, tool_call_id=tool_id))
    return out


def _tool_uses(
    role: str, content: str | list[dict[str, Any]], where: str
) -> list[serving_pb2.ToolCall]:
    """An assistant turn's `tool_use` blocks as its calls."""
    if isinstance(content, str):
        return []
    calls = []
    for j, block in enumerate(content):
        if block.get("type") != "tool_use":
            continue
        if role != "assistant":
            raise HttpError.invalid(f"{where}[{j}]", "tool_use blocks come in an assistant turn")
        name, tool_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
        if not isinstance(name, str) or not isinstance(tool_id, str):
            raise HttpError.invalid(f"{where}[{j}]", "a tool_use block needs an id and a name")
        if not isinstance(arguments, dict):
            raise HttpError.invalid(f"{where}[{j}].input", "must be an object")
        calls.append(serving_pb2.ToolCall(id=tool_id, name=name, arguments=json.dumps(arguments)))
    return calls


def _message(
    role: str,
    content: str | list[dict[str, Any]],
    where: str,
    chat: ChatPrompt,
    skip: tuple[str, ...] = (),
) -> serving_pb2.ChatMessage:
    """A message: its text (text blocks joined by newlines, as OpenAI's text parts are), or,
    with image blocks, its blocks in order (each image's file appended to `chat.images`).
    Blocks of the types in `skip` are another helper's."""
    if isinstance(content, str):
        return serving_pb2.ChatMessage(role=role, content=content)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind in skip:
            continue
        if kind == "image":
            chat.image_fields.append(f"{where}[{j}].source")
            chat.images.append(anthropic_image(block, f"{where}[{j}]"))
            parts.append(serving_pb2.ChatPart(image=len(chat.images) - 1))
            continue
        if kind != "text" or set(block) - {"type", "text", "cache_control", "citations"}:
            raise HttpError.invalid(
                f"{where}[{j}]", f"only text and image blocks are served, got type {kind!r}"
            )
        if not isinstance(block.get("text"), str):
            raise HttpError.invalid(f"{where}[{j}].text", "must be a string")
        parts.append(serving_pb2.ChatPart(text=block["text"]))
    if not any(p.WhichOneof("part") == "image" for p in parts):
        return serving_pb2.ChatMessage(role=role, content="\n".join(p.text for p in parts))
    return serving_pb2.ChatMessage(role=role, parts=parts)


def stop_reason(
    finish: str | None, stop_string: str | None, calls: list[ToolCall] | None = None
) -> str | None:
    if stop_string:
        return "stop_sequence"
    if calls and finish == "stop":
        return "tool_use"
    return STOP_REASONS.get(finish or "", finish)


def usage(counts: Counts) -> MessageUsage:
    cached = counts.cached_tokens
    return MessageUsage(
        input_tokens=counts.prompt_tokens - cached,
        output_tokens=counts.completion_tokens,
        cache_read_input_tokens=cached,
    )


NO_THINKING = Thinking()


async def events(
    message_id: str,
    model: str,
    first: serving_pb2.GenerateResponse,
    rest: Responses,
    tools: frozenset[str] = frozenset(),
    thinking: Thinking = NO_THINKING,
) -> AsyncIterator[bytes]:
    """message_start; with thinking shown, a `thinking` block (its deltas, its signature) from
    the first reasoning; a text block's start, deltas and stop; each call's tool_use block (its
    input in one input_json_delta), message_delta (stop reason, output tokens), message_stop;
    a failure mid-way is an `error` event. With tools, the text block starts at the first text,
    so an answer of calls alone is calls alone, as when not streamed."""
    cached = first.cached_prompt_tokens
    opening = MessageUsage(
        input_tokens=first.prompt_tokens - cached, output_tokens=0, cache_read_input_tokens=cached
    )
    start = Message(
        id=message_id, model=model, content=[], stop_reason=None, usage=opening
    ).model_dump()
    yield _event("message_start", {"type": "message_start", "message": start})
    counts = Counts()
    finish, stop_string = None, None
    held = HeldCalls(tools) if tools else None
    calls: list[ToolCall] = []
    blocks = _Blocks(thinking.omitted)
    try:
        async with contextlib.aclosing(read(prepend(first, rest), counts)) as responses:
            async for response in responses:
                if thinking.shown and response.reasoning_text:
                    yield blocks.think(response.reasoning_text)
                text = held.feed(response.text) if held is not None else response.text
                if response.finished and response.finish_reason == FINISH_ABORT:
                    yield _event("error", aborted().anthropic_body())
                    return
                if response.finished:
                    finish, stop_string = response.finish_reason, response.stop_string or None
                    if held is not None:
                        rest_text, calls = held.finish()
                        text += rest_text
                if text or (held is None and not thinking.shown):  # opens at once, as before
                    yield blocks.write(text)
    except (ServingError, GenerationFailed) as err:
        yield _event("error", HttpError.of(err).anthropic_body())
        return
    yield blocks.close(empty=not calls)
    for index, call in enumerate(calls, start=blocks.count):
        block = tool_use(call).model_dump() | {"input": {}}
        yield _block_start(index, block)
        yield _delta(index, {"type": "input_json_delta", "partial_json": call.arguments})
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
    reason = stop_reason(finish, stop_string, calls)
    stop = {"stop_reason": reason, "stop_sequence": stop_string}
    output = {"output_tokens": counts.completion_tokens}
    yield _event("message_delta", {"type": "message_delta", "delta": stop, "usage": output})
    yield _event("message_stop", {"type": "message_stop"})


class _Blocks:
    """A streamed message's thinking and text blocks: their starts, deltas and stops, the
    thinking block's signature last (`omitted`: its text is left out)."""

    def __init__(self, omitted: bool) -> None:
        self.omitted = omitted
        self.count = 0
        """Blocks started."""
        self.thought: list[str] | None = None
        """The open thinking block's text; None: none is open."""
        self.writing = False
        """The text block is open."""

    def think(self, text: str) -> bytes:
        out = b""
        if self.thought is None:
            self.thought = []
            out += self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.thought.append(text)
        if not self.omitted:
            out += _delta(self.count - 1, {"type": "thinking_delta", "thinking": text})
        return out

    def write(self, text: str) -> bytes:
        out = self._stop_thinking()
        if not self.writing:
            self.writing = True
            out += self._start({"type": "text", "text": ""})
        if text:
            out += _delta(self.count - 1, {"type": "text_delta", "text": text})
        return out

    def close(self, empty: bool) -> bytes:
        """Stop the open block (`empty`: with no block at all, an empty text block first)."""
        out = self._stop_thinking()
        if empty and not self.count:
            out += self.write("")
        if self.writing:
            self.writing = False
            out += _event(
                "content_block_stop", {"type": "content_block_stop", "index": self.count - 1}
            )
        return out

    def _start(self, block: dict[str, Any]) -> bytes:
        self.count += 1
        return _block_start(self.count - 1, block)

    def _stop_thinking(self) -> bytes:
        if self.thought is None:
            return b""
        sign = {"type": "signature_delta", "signature": signature("".join(self.thought))}
        self.thought = None
        stop = {"type": "content_block_stop", "index": self.count - 1}
        return _delta(self.count - 1, sign) + _event("content_block_stop", stop)


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    body = {"type": "content_block_delta", "index": index, "delta": delta}
    return _event("content_block_delta", body)


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    return _event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
