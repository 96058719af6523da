"""A request's images on the router: placed, checked, named as the client named them, keyed.

    gRPC chat   ChatMessage.parts: text parts and image parts (an index into `images`) become
                a content of {"type": "text", "text"} / {"type": "image"} parts, which the chat
                template renders (worker/validation.py); the images go to the worker in the
                order their parts appear, each placed exactly once
    text        one "<image>" per image, in order        token ids: one image token per image

A bad image is refused naming the part the client sent it in: "images[2]" on gRPC, the
message part on HTTP ("messages[0].content[1].image_url"), which the HTTP face hands down as
`fields` (field k names image k of the request). An image prompt routes by the keys of its
cache tokens (worker/image_prompt.py `cache_tokens`: text ids, and one ImageToken per tile run
named by the image's content hash), so a follow-up turn that sends the same image again goes
to the worker holding its KV. Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from cache import to_cache_keys
from cache.tokens import Keys
from protos.radixmesh.v1 import serving_pb2
from worker.errors import InvalidRequest
from worker.image_prompt import ImagePromptSpec, PromptImage, cache_tokens
from worker.images import CheckedImage
from worker.tool_calls import ToolCall


def image_fields(count: int, given: Sequence[str] = ()) -> list[str]:
    """What each of a request's `count` images is called in refusals."""
    if given and len(given) != count:
        raise ValueError(f"{len(given)} names for {count} images")
    return list(given) if given else [f"images[{k}]" for k in range(count)]


def chat_messages(
    chat: serving_pb2.ChatMessages, images: int
) -> tuple[tuple[dict[str, Any], ...], list[int]]:
    """The conversation as the chat template takes it, and the request's image indices in the
    order their parts appear (each image placed exactly once)."""
    order: list[int] = []
    messages = []
    for i, message in enumerate(chat.messages):
        problem = name_problem(message.role, message.name) if message.name else None
        if problem is not None:
            raise InvalidRequest(f"chat.messages[{i}].name", problem)
        if not message.parts:
            messages.append({"role": message.role, "content": message.content, **_tools(message)})
            continue
        if message.content:
            raise InvalidRequest(f"chat.messages[{i}]", "give its content or its parts, not both")
        content = []
        for j, part in enumerate(message.parts):
            where = f"chat.messages[{i}].parts[{j}]"
            kind = part.WhichOneof("part")
            if kind == "text":
                content.append({"type": "text", "text": part.text})
            elif kind == "image":
                if part.image >= images:
                    raise InvalidRequest(
                        f"{where}.image", f"{part.image}, but the request has {images} images"
                    )
                if part.image in order:
                    raise InvalidRequest(
                        f"{where}.image", f"image {part.image} is placed twice; send it twice"
                    )
                order.append(part.image)
                content.append({"type": "image"})
            else:
                raise InvalidRequest(where, "set its text or its image")
        messages.append({"role": message.role, "content": content, **_tools(message)})
    unplaced = sorted(set(range(images)) - set(order))
    if unplaced:
        raise InvalidRequest(f"images[{unplaced[0]}]", "no chat part places it (ChatPart.image)")
    return tuple(messages), order


NAME = re.compile(r"[^\s<|\\/>]{1,64}")
"""A participant's name, as OpenAI takes one: 1-64 characters, no whitespace and none of
< | \\ / > (so a name a template writes cannot open a turn of its own)."""


def name_problem(role: str, name: str) -> str | None:
    """What is wrong with a message's `name` (None: nothing)."""
    if role == "tool":
        return "a tool message has none (its tool_call_id names the call)"
    if not NAME.fullmatch(name):
        return f"{name[:80]!r} is not 1-64 characters without whitespace or any of < | \\ / >"
    return None


def _tools(message: serving_pb2.ChatMessage) -> dict[str, Any]:
    """A message's tool fields, reasoning and name, where it has them (a template tests for
    the keys)."""
    fields: dict[str, Any] = {}
    if message.name:
        fields["name"] = message.name
    if message.tool_calls:
        fields["tool_calls"] = tuple(
            ToolCall(call.name, call.arguments, call.id) for call in message.tool_calls
        )
    if message.tool_call_id:
        fields["tool_call_id"] = message.tool_call_id
    if message.reasoning_content:
        fields["reasoning_content"] = message.reasoning_content
    return fields


def check_count(fields: Sequence[str], max_images: int) -> None:
    """Refuse more images than allowed, naming the first one past the limit."""
    if len(fields) > max_images:
        raise InvalidRequest(
            fields[max_images],
            f"image {max_images + 1} of {len(fields)}: at most {max_images} images are allowed "
            "per request",
        )


def renamed(err: InvalidRequest, fields: Sequence[str]) -> InvalidRequest:
    """A refusal of "images[k]" as the client named image k."""
    if err.field.startswith("images[") and err.field.endswith("]"):
        index = err.field[len("images[") : -1]
        if index.isdigit() and int(index) < len(fields):
            problem = str(err).removeprefix(f"{err.field}: ")
            return type(err)(fields[int(index)], problem)
    return err


def prompt_images(images: Sequence[CheckedImage]) -> list[PromptImage]:
    return [PromptImage(i.content_hash, i.width, i.height) for i in images]


def image_cache_keys(
    ids: Sequence[int], images: Sequence[CheckedImage], spec: ImagePromptSpec
) -> Keys:
    """The cache keys of an image prompt's positions: what its routing blocks hash, the same
    keys the worker's cache holds for it."""
    return to_cache_keys(cache_tokens(ids, prompt_images(images), spec))
