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
MODES = ("auto", "required", "none")
"""tool_choice's modes: no tool may be called one of these, as a named choice is the name."""
_JSON = json.JSONDecoder()
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
        if tool.name in MODES:
            raise InvalidRequest(f"{where}.name", f"{tool.name!r} is a mode of tool_choice")
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
        if schema.get("type", "object") != "object":
            raise InvalidRequest(
                f"{where}.parameters",
                f"a call's arguments are an object; this schema's type is {schema['type']!r}",
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
    """The content and the calls of a generated text, `tools` naming the functions that may be
    called. The content is the text with the calls taken out, as it was (None when only
    whitespace is left: an answer of calls alone). A tag whose body is not a call of one of
    them stays in the content, as does a call cut off by max_tokens."""
    content, calls = split_calls(text, tools)
    return (content if content.strip() or not calls else None), calls


def split_calls(text: str, tools: Collection[str]) -> tuple[str, list[ToolCall]]:
    """The text with its calls taken out, and the calls."""
    found = find_calls(text, tools)
    return taken_out(text, found), [call for call, _, _ in found]


def taken_out(text: str, found: Sequence[tuple[ToolCall, int, int]]) -> str:
    """The text less the calls `find_calls` found in it."""
    kept, last = [], 0
    for _, begin, end in found:
        kept.append(text[last:begin])
        last = end
    kept.append(text[last:])
    return "".join(kept)


def find_calls(text: str, tools: Collection[str]) -> list[tuple[ToolCall, int, int]]:
    """Each call in the text, with where its opening tag begins and its closing tag ends."""
    found, at = [], text.find(BEGIN)
    while at >= 0:
        read = _call(text, at + len(BEGIN), tools)
        if read is None:
            at = text.find(BEGIN, at + 1)
            continue
        call, end = read
        found.append((call, at, end))
        at = text.find(BEGIN, end)
    return found


def _call(text: str, start: int, names: Collection[str]) -> tuple[ToolCall, int] | None:
    """The call whose JSON begins after `start` (whitespace first), and where its closing tag
    ends; None if there is none. The JSON is read whole, so an argument may hold the tag."""
    begin = len(text) - len(text[start:].lstrip())
    try:
        value, end = _JSON.raw_decode(text, begin)
    except ValueError:
        return None
    rest = len(text) - len(text[end:].lstrip())
    if not text.startswith(END, rest):
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), call_id), rest + len(
        END
    )


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
    user turn of `<tool_response>` blocks (as Qwen 2.5's template renders them). A content of
    parts (a vision model's) stays parts, the written text a text part after them."""
    out: list[dict[str, Any]] = []
    responses = False  # the last turn out is a run of tool results
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            response = f"<tool_response>\n{_text(content)}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            responses = True
            continue
        responses = False
        written = [
            f'{BEGIN}\n{{"name": {json.dumps(c.name)}, "arguments": '
            f"{json.dumps(_arguments(c, i, j), ensure_ascii=False)}}}\n{END}"
            for j, c in enumerate(message.get("tool_calls") or [])
        ]
        turn = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        out.append(turn | {"content": _appended(content, "\n".join(written))})
    if tools:
        listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
        preamble = TOOLS_PREAMBLE.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0]["content"] = _appended(out[0]["content"], preamble, "\n\n")
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _text(content: str | Sequence[dict[str, Any]]) -> str:
    """A content's text (of a list of parts, its text parts', joined as a text model's are)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _appended(
    content: str | Sequence[dict[str, Any]], text: str, between: str = "\n"
) -> str | list[dict[str, Any]]:
    """`content` with `text` after it: a string, or its parts with a text part after them (a
    vision model's turns are parts)."""
    if not text:
        return content if isinstance(content, str) else list(content)
    if isinstance(content, str):
        return f"{content}{between}{text}" if content else text
    return [*content, {"type": "text", "text": between + text if content else text}]


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
