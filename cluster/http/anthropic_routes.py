"""POST /v1/messages (Anthropic's Messages API, text and image content, streamed or not) and
/v1/messages/count_tokens (text and images), over the same serving core as everything else.

Image blocks carry base64 files (cluster/http/image_parts.py); each goes to
GenerateRequest.images, placed by a ChatPart where it was, and is named by its block when
refused ("messages[0].content[1].source").

finish reasons: a stop sequence -> stop_reason "stop_sequence" (and which, in stop_sequence),
any other stop -> "end_turn", "length" -> "max_tokens". Usage counts prompt tokens read from the
prefix cache as `cache_read_input_tokens` and the rest as `input_tokens`, as Anthropic does.
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
    TokenCount,
)
from cluster.http.errors import GenerationFailed, HttpError
from cluster.http.image_parts import anthropic_image
from cluster.http.openai_params import ChatPrompt
from cluster.http.openai_responses import (
    Counts,
    Responses,
    collect,
    prepend,
    read,
    served_by,
)
from cluster.http.sse import EventStream
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2

if TYPE_CHECKING:
    from cluster.http.app import HttpApi

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def add_routes(app: FastAPI, api: HttpApi) -> None:
    async def messages(body: MessagesRequest, request: Request) -> Response:
        caller = api.caller(request)
        adapter = api.check_model(body.model)
        rid = api.request_id(request)
        message, image_fields = generate_request(body, rid, api.tenant(request))
        message.namespace.adapter = adapter or ""
        model = adapter or api.model
        stream = api.start(message, caller, image_fields=image_fields)
        if body.stream:
            first = await api.finish(request, anext(stream))  # a refusal: a status, not an event
            return EventStream(events(f"msg_{rid}", model, first, stream), served_by(first))
        samples, counts = await api.finish(request, collect(stream))
        sample = samples[0]
        reply = Message(
            id=f"msg_{rid}",
            model=model,
            content=[TextBlock(text="".join(sample.text))],
            stop_reason=stop_reason(sample.finish_reason, sample.stop_string),
            stop_sequence=sample.stop_string,
            usage=usage(counts),
        )
        return JSONResponse(reply.model_dump(), headers=counts.served_by())

    async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
        caller = api.caller(request)
        api.check_model(body.model)
        for name in ("tools", "tool_choice", "thinking"):
            if getattr(body, name) is not None:
                raise HttpError.invalid(name, REFUSED[name][0])
        chat = chat_prompt(body)
        if chat.images:  # placed and expanded as a request would be: what usage will report
            ids = await api.chat_prompt_ids(chat, caller, api.tenant(request))
            return TokenCount(input_tokens=len(ids))
        text = await api.render(chat.messages)
        return TokenCount(input_tokens=len(await api.encode(text, False, "messages")))

    app.add_api_route("/v1/messages", messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])


def generate_request(
    body: MessagesRequest, request_id: str, tenant: str
) -> tuple[serving_pb2.GenerateRequest, list[str]]:
    """The request, and what its images are called in refusals."""
    for name, (why, accepted) in REFUSED.items():
        value = getattr(body, name)
        if value is not None and value not in accepted:
            raise HttpError.invalid(name, f"{why} (radixmesh refuses it rather than ignore it)")
    sampling = serving_pb2.SamplingParams(stop=body.stop_sequences or [])
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
    )
    message.namespace.tenant = tenant
    return message, chat.image_fields


def chat_prompt(body: MessagesRequest | CountTokensRequest) -> ChatPrompt:
    chat = ChatPrompt()
    if body.system is not None:
        system = _message("system", body.system, "system", chat)
        if system.parts:
            raise HttpError.invalid("system", "images go in the messages, not the system prompt")
        chat.messages.append(system)
    for i, each in enumerate(body.messages):
        chat.messages.append(_message(each.role, each.content, f"messages[{i}].content", chat))
    return chat


def _message(
    role: str, content: str | list[dict[str, Any]], where: str, chat: ChatPrompt
) -> serving_pb2.ChatMessage:
    """A message: its text (text blocks joined by newlines, as OpenAI's text parts are), or,
    with image blocks, its blocks in order (each image's file appended to `chat.images`)."""
    if isinstance(content, str):
        return serving_pb2.ChatMessage(role=role, content=content)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type")
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


def stop_reason(finish: str | None, stop_string: str | None) -> str | None:
    if stop_string:
        return "stop_sequence"
    return STOP_REASONS.get(finish or "", finish)


def usage(counts: Counts) -> MessageUsage:
    cached = counts.cached_tokens
    return MessageUsage(
        input_tokens=counts.prompt_tokens - cached,
        output_tokens=counts.completion_tokens,
        cache_read_input_tokens=cached,
    )


async def events(
    message_id: str,
    model: str,
    first: serving_pb2.GenerateResponse,
    rest: Responses,
) -> AsyncIterator[bytes]:
    """message_start, a text block's start, deltas and stop, message_delta (stop reason, output
    tokens), message_stop; a failure mid-way is an `error` event."""
    cached = first.cached_prompt_tokens
    opening = MessageUsage(
        input_tokens=first.prompt_tokens - cached, output_tokens=0, cache_read_input_tokens=cached
    )
    start = Message(
        id=message_id, model=model, content=[], stop_reason=None, usage=opening
    ).model_dump()
    yield _event("message_start", {"type": "message_start", "message": start})
    text: dict[str, Any] = {"type": "text", "text": ""}
    block = {"type": "content_block_start", "index": 0, "content_block": text}
    yield _event("content_block_start", block)
    counts = Counts()
    finish, stop_string = None, None
    try:
        async with contextlib.aclosing(read(prepend(first, rest), counts)) as responses:
            async for response in responses:
                if response.text:
                    delta = {"type": "text_delta", "text": response.text}
                    yield _event(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": 0, "delta": delta},
                    )
                if response.finished:
                    finish, stop_string = response.finish_reason, response.stop_string or None
    except (ServingError, GenerationFailed) as err:
        yield _event("error", HttpError.of(err).anthropic_body())
        return
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    stop = {"stop_reason": stop_reason(finish, stop_string), "stop_sequence": stop_string}
    output = {"output_tokens": counts.completion_tokens}
    yield _event("message_delta", {"type": "message_delta", "delta": stop, "usage": output})
    yield _event("message_stop", {"type": "message_stop"})


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
