"""The Responses API's input items as the chat's turns: each kind's fields checked and read,
a refusal naming the item (`where`: what the request calls it, as `input[2]`). Used for a
response's input, a stored conversation it continues, and a conversation's items as they are
added (cluster/http/conversations.py)."""

from __future__ import annotations

import json
from typing import Any

from cluster.http.errors import HttpError
from cluster.http.openai_params import ROLES
from cluster.http.responses_output import unsealed
from protos.radixmesh.v1 import serving_pb2

TEXT_PARTS = ("input_text", "output_text")
"""The content parts of an input message served (an assistant's earlier turn is output_text)."""
KINDS = ("message", "reasoning", "function_call", "function_call_output")


def check_item(item: dict[str, Any], where: str) -> None:
    """400 naming what of an item would not render as a turn of the chat."""
    kind = item.get("type", "message")
    if kind == "reasoning":
        reasoning_text(item, where)
    elif kind == "message":
        chat_message(item, where)
    elif kind == "function_call":
        tool_call(item, where)
    elif kind == "function_call_output":
        tool_output(item, where)
    else:
        raise unknown_kind(kind, where)


def unknown_kind(kind: object, where: str) -> HttpError:
    return HttpError.invalid(
        f"{where}.type",
        f"{kind!r}: the items served are message, reasoning, function_call and "
        "function_call_output",
    )


def reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `content` (the reasoning text a thinking model wrote), else
    its `summary`, else the text its `encrypted_content` holds if radixmesh wrote it
    (responses_output.py `sealed`; another server's is nothing radixmesh can read)."""
    for name, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(name) or []
        if not isinstance(parts, list):
            raise HttpError.invalid(f"{where}.{name}", "must be a list of text parts")
        texts = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_type:
                raise HttpError.invalid(f"{where}.{name}[{j}]", f"must be a {part_type} part")
            if not isinstance(part.get("text"), str):
                raise HttpError.invalid(f"{where}.{name}[{j}].text", "must be a string")
            texts.append(part["text"])
        if texts:
            return "\n".join(texts)
    return unsealed(item.get("encrypted_content")) or ""


def chat_message(item: dict[str, Any], where: str) -> serving_pb2.ChatMessage:
    unknown = set(item) - {"type", "role", "content", "id", "status"}
    if unknown:
        raise HttpError.invalid(f"{where}.{sorted(unknown)[0]}", "is not a field of a message")
    given = item.get("role")
    role = ROLES.get(given) if isinstance(given, str) else None
    if role is None or role == "tool":
        raise HttpError.invalid(
            f"{where}.role",
            f"{item.get('role')!r} is not one of system, developer, user, assistant",
        )
    content = item.get("content")
    if isinstance(content, str):
        return serving_pb2.ChatMessage(role=role, content=content)
    if not isinstance(content, list):
        raise HttpError.invalid(f"{where}.content", "must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise HttpError.invalid(
                f"{where}.content[{j}]",
                f"only input_text and output_text parts are served, got {kind!r}",
            )
        texts.append(part["text"])
    return serving_pb2.ChatMessage(role=role, content="\n".join(texts))


def tool_call(item: dict[str, Any], where: str) -> serving_pb2.ToolCall:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str):
            raise HttpError.invalid(f"{where}.{field}", "is required, a string")
    try:
        parsed = json.loads(arguments)  # type: ignore[arg-type]
    except ValueError as err:
        raise HttpError.invalid(f"{where}.arguments", f"is not JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise HttpError.invalid(f"{where}.arguments", "is a JSON object of the arguments")
    return serving_pb2.ToolCall(id=call_id, name=name, arguments=arguments)


def tool_output(item: dict[str, Any], where: str) -> serving_pb2.ChatMessage:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise HttpError.invalid(f"{where}.call_id", "is required, a string")
    if isinstance(output, list):  # text parts
        texts = [
            p.get("text") for p in output if isinstance(p, dict) and p.get("type") in TEXT_PARTS
        ]
        if len(texts) != len(output) or not all(isinstance(t, str) for t in texts):
            raise HttpError.invalid(f"{where}.output", "only input_text parts are served")
        output = "\n".join(texts)  # type: ignore[arg-type]
    if not isinstance(output, str):
        raise HttpError.invalid(f"{where}.output", "must be a string or text parts")
    return serving_pb2.ChatMessage(role="tool", content=output, tool_call_id=call_id)
