"""Tool calling (OpenAI's `tools`): the tools shown to the model, the constraint its calls are
generated under, and the calls read back from its text. Imports no torch (the router uses it).

One format for every model, Hermes's, which Qwen 2.5 and 3, Hermes 2 and 3 and many other
models are trained on and vLLM's `hermes` parser reads:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- A chat template that renders `tools` gets them, and the conversation's calls and results, as
  transformers passes them. For one that does not (SmolLM2's), the tools are described in the
  system message and the calls and results are written into the turns in this format, in Qwen
  2.5's words (`plain_conversation`).
- The calls are generated under an xgrammar structural tag (`tool_constraint`): inside
  `<tool_call>` only a call of one of the tools, its arguments valid for the tool's parameters.
  `tool_choice: "auto"` lets text come first and a call begin at the tag; "required" and a named
  function begin with a call and allow only calls; `parallel_tool_calls: false` stops after one.
- The calls are read back from the text in the same format (`read_calls`); the text around them
  is the message's content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from worker.errors import InvalidRequest
from worker.sampling_params import StructuredOutput

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name."""
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function declared without parameters takes none (OpenAI's reading)."""
BEGIN, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""How the tools are described to a model whose template does not render them (Qwen 2.5's
template's words)."""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None = None
    parameters: str = json.dumps(NO_PARAMETERS)
    """A JSON Schema, as JSON text."""

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's API (and a chat template's `tools`) spells it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """A JSON object, as JSON text (what OpenAI's API sends)."""
    id: str = ""


def check_tools(tools: Sequence[Tool], field: str = "tools") -> None:
    """Refuse tools no model could be asked to call, naming the first."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(field, f"{len(tools)} tools; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidRequest(
                f"{where}.name", f"{tool.name!r} is not 1-64 of a-z, A-Z, 0-9, _ and -"
            )
        if tool.name in seen:
            raise InvalidRequest(f"{where}.name", f"{tool.name!r} is declared twice")
        seen.add(tool.name)
        try:
            schema = json.loads(tool.parameters)
        except ValueError as err:
            raise InvalidRequest(f"{where}.parameters", f"is not JSON: {err}") from None
        if not isinstance(schema, dict):
            raise InvalidRequest(
                f"{where}.parameters", f"a schema is an object, got {type(schema).__name__}"
            )


def tool_constraint(
    tools: Sequence[Tool], choice: str, parallel: bool = True
) -> StructuredOutput | None:
    """The structured output that calls are generated under: `choice` is "auto", "required",
    "none" (None: free text) or the name of the one function to call."""
    if choice == "none" or not tools:
        return None
    chosen = list(tools)
    if choice not in ("auto", "required"):
        chosen = [tool for tool in tools if tool.name == choice]
        if not chosen:
            raise InvalidRequest(
                "tool_choice", f"{choice!r} is not one of the tools: {[t.name for t in tools]}"
            )
    tags = [_tag(tool) for tool in chosen]
    if choice == "auto":
        form: dict[str, Any] = {"type": "triggered_tags", "triggers": [BEGIN], "tags": tags}
        form |= {"at_least_one": False, "stop_after_first": not parallel}
    else:
        form = {"type": "tags_with_separator", "tags": tags, "separator": "\n"}
        form |= {"at_least_one": True, "stop_after_first": not parallel or choice != "required"}
    spec = json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)
    return StructuredOutput("structural_tag", spec)


def _tag(tool: Tool) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": f'{BEGIN}\n{{"name": {json.dumps(tool.name)}, "arguments": ',
        "content": {"type": "json_schema", "json_schema": json.loads(tool.parameters)},
        "end": f"}}\n{END}",
    }


def read_calls(text: str, tools: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """The content (the text outside the calls; None if nothing is left) and the calls of a
    generated text, `tools` naming the functions that may be called. A tag whose body is not a
    call of one of them stays in the content, as does a call cut off by max_tokens."""
    calls, kept, last = [], [], 0
    for found in _CALL.finditer(text):
        call = _call(found.group(1), tools)
        if call is None:
            continue
        kept.append(text[last : found.start()])
        last = found.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def _call(body: str, names: Collection[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text, f"call_{uuid.uuid4().hex[:24]}")


def template_conversation(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a template that renders tools: each call's arguments as an object (the
    templates write them with `tojson`, as transformers expects), an assistant turn with calls
    and no text given an empty content."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        converted = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call, i, j)},
            }
            for j, call in enumerate(calls)
        ]
        out.append({**message, "content": message.get("content") or "", "tool_calls": converted})
    return out


def plain_conversation(
    messages: Sequence[dict[str, Any]], tools: Sequence[Tool]
) -> list[dict[str, Any]]:
    """The messages for a template that knows nothing of tools: the tools described at the
    end of the system message (one is added first if there is none), each assistant call
    written in its turn as the model is asked to write it, and each run of tool results as one
    user turn of `<tool_response>` blocks (as Qwen 2.5's template renders them)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
            continue
        calls = message.get("tool_calls") or []
        written = [
            f'{BEGIN}\n{{"name": {json.dumps(c.name)}, "arguments": '
            f"{json.dumps(_arguments(c, i, j), ensure_ascii=False)}}}\n{END}"
            for j, c in enumerate(calls)
        ]
        out.append({"role": role, "content": "\n".join([content] * bool(content) + written)})
    for message in out:
        message.pop("tool_responses", None)
    if tools:
        listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (
                f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble
            )
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _arguments(call: ToolCall, i: int, j: int) -> Any:
    try:
        value = json.loads(call.arguments)
    except ValueError as err:
        raise InvalidRequest(
            f"messages[{i}].tool_calls[{j}].function.arguments", f"is not JSON: {err}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"messages[{i}].tool_calls[{j}].function.arguments",
            f"is a JSON object of the arguments, got {type(value).__name__}",
        )
    return value
