"""OpenAI's legacy function calling, served as tools.

Before tools, OpenAI's chat API took `functions` (the definitions), `function_call` ("none",
"auto" or `{"name": ...}`), an assistant turn's single `function_call` and a `function` role
for its result; the answer's call came as `message.function_call` with finish_reason
"function_call". OpenAI deprecated it, and the pre-1.0 `openai` SDK, LangChain's older agents
and other compatibility layers still send it. vLLM and SGLang refuse it; radixmesh serves it:
`modern` rewrites such a request as its tools equivalent, one call at most an answer
(`parallel_tool_calls: false`, as the legacy API gave one), and the response writers give the
call back in the legacy shape (`function_call_out`, `LEGACY_FINISH`) when the request had
`functions`.

A `function` message answers its assistant's call of the same name in the turn before it, as
a tool message with the id given to that call (`call_<i>`, i the assistant message's index); a
result no call asked for gets an id of its own, as OpenAI took such messages without one.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.http.errors import HttpError
from cluster.http.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    ToolCallDelta,
    ToolCallOut,
    ToolCallParam,
    ToolParam,
)

LEGACY_FINISH = "function_call"
"""The finish_reason of an answer that is a call, in the legacy shape ("tool_calls" with tools)."""

LEGACY_FIELDS = ((r"tools\[(\d+)\]\.(name|description|parameters)", r"functions[\1].\2"),)
"""A function's fields as the serving core names them (tools) -> as the legacy body does."""


def legacy(request: ChatCompletionRequest) -> bool:
    """Whether the request defines functions the legacy way (its answer's call comes back that
    way too). An empty list asks for nothing, as it did when `functions` was refused."""
    return bool(request.functions)


def modern(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """The request with its functions as tools, its function_call as their tool_choice and its
    conversation's calls and results as tool calls and tool messages (itself when it has
    none). `functions` stays set, so `legacy` still tells. Without functions, `function_call`
    "none" or "auto" asks for nothing (tools, if any, follow tool_choice) and a named one is
    refused."""
    messages = conversation(request.messages)
    if request.functions is None and request.function_call is None and messages is None:
        return request
    changes: dict[str, object] = {"function_call": None}
    if messages is not None:
        changes["messages"] = messages
    choice = request.function_call
    if request.functions:
        changes |= _as_tools(request)
    elif choice is not None and not isinstance(choice, str):
        raise HttpError.invalid("function_call", f"names {choice.name!r}; give functions")
    return request.model_copy(update=changes)


def _as_tools(request: ChatCompletionRequest) -> dict[str, object]:
    """The tools fields of a request with functions."""
    assert request.functions
    if request.tools is not None:
        raise HttpError.invalid("functions", "give tools or functions, not both")
    if request.parallel_tool_calls:
        raise HttpError.invalid(
            "parallel_tool_calls", "with functions an answer has one call; send tools for more"
        )
    if request.tool_choice is not None:  # a refusal of the choice is named function_call
        raise HttpError.invalid("tool_choice", "is for tools; with functions give function_call")
    tools = [ToolParam(type="function", function=f) for f in request.functions]
    changes: dict[str, object] = {"tools": tools, "parallel_tool_calls": False}
    choice = request.function_call
    if choice is None:
        return changes
    if isinstance(choice, str):
        changes["tool_choice"] = choice
    else:
        changes["tool_choice"] = NamedToolChoice(type="function", function=choice)
    return changes


def conversation(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """The conversation with each legacy call and result as a tool call and a tool message
    (None: it has neither)."""
    if not any(m.function_call is not None or m.role == "function" for m in messages):
        return None
    out, asked = [], dict[str, str]()  # the last assistant turn's call: name -> its id
    for i, each in enumerate(messages):
        call, turn = each.function_call, each
        if call is not None:
            if each.role != "assistant":
                raise HttpError.invalid(
                    f"messages[{i}].function_call", "only an assistant's turn has a call"
                )
            if each.tool_calls:
                raise HttpError.invalid(
                    f"messages[{i}].function_call", "give tool_calls or function_call, not both"
                )
            asked = {call.name: f"call_{i}"}
            called = ToolCallParam(id=f"call_{i}", function=call)
            turn = each.model_copy(update={"function_call": None, "tool_calls": [called]})
        elif each.role == "function":
            turn = _result(each, i, asked)
        elif each.role == "assistant":
            asked = {}
        out.append(turn)
    return out


def _result(message: ChatMessage, i: int, asked: dict[str, str]) -> ChatMessage:
    """A function's result as the tool message answering the call it names."""
    if not isinstance(message.name, str) or not message.name:
        raise HttpError.invalid(f"messages[{i}].name", "is required: the function that answered")
    if message.content is not None and not isinstance(message.content, str):
        raise HttpError.invalid(f"messages[{i}].content", "a function's result is text")
    answers = asked.pop(message.name, f"call_{i}")
    return ChatMessage(role="tool", content=message.content or "", tool_call_id=answers)


def function_call_out(calls: Sequence[ToolCallOut | ToolCallDelta]) -> FunctionCall | None:
    """The legacy answer's call: the first (there is one at most, `modern` asks for that)."""
    return calls[0].function if calls else None
