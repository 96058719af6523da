"""Tool calls: the tools and the turns written for a template with or without a place for
them, the constraint compiled and obeyed by the random tiny model, and the calls read back
from text, whole or streamed in any pieces."""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest
import xgrammar
from hypothesis import given
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from cluster.http.openai_responses import HeldCalls
from tests.worker.helpers import Recorder, drain
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.request import FINISH_STOP, GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tokenizer import Tokenizer
from worker.tool_calls import (
    Tool,
    ToolCall,
    check_tools,
    plain_conversation,
    read_calls,
    template_conversation,
    tool_constraint,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = (
    Tool("get_weather", "The forecast for a city", json.dumps(WEATHER)),
    Tool("get_time", None, json.dumps(CLOCK)),
)
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
NAMES = frozenset(SCHEMAS)
CONVERSATION = (
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": (ToolCall("get_weather", '{"city": "Paris", "days": 2}', "call_1"),),
    },
    {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"},
    {"role": "tool", "content": '{"wind": 3}', "tool_call_id": "call_2"},
)
QWEN_LIKE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def engine_for(loaded: LoadedModel) -> Engine:
    config = EngineConfig(num_pages=512, page_size=4, model_revision=loaded.revision)
    return Engine(loaded.model, loaded.tokenizer, config)


def calls_of(loaded: LoadedModel, choice: str, parallel: bool = True, n: int = 4) -> list:
    """(text, content, calls) of each of n samples; a constraint that calls must end them."""
    constraint = tool_constraint(TOOLS, choice, parallel)
    sampling = SamplingParams(max_tokens=200, temperature=1.0, seed=9, n=n, structured=constraint)
    request = GenerateRequest("t", messages=CONVERSATION[:1], sampling=sampling, tools=TOOLS)
    engine, recorder = engine_for(loaded), Recorder()
    engine.submit(request, recorder.outputs.append)
    drain(engine)
    check_sequence_cache(engine.cache)
    out = []
    for i in range(n):
        if choice != "auto":  # free text may run to max_tokens
            assert recorder.final("t", i).finish_reason == FINISH_STOP
        text = "".join(o.text for o in recorder.by_request()["t"] if o.index == i)
        out.append((text, *read_calls(text, NAMES)))
    return out


def test_required_calls_are_calls_of_the_tools_with_valid_arguments(tiny: LoadedModel) -> None:
    for text, content, calls in calls_of(tiny, "required"):
        assert calls, text
        assert content is None, text  # nothing but calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.id.startswith("call_")


def test_a_named_function_is_called_once(tiny: LoadedModel) -> None:
    for text, _, calls in calls_of(tiny, "get_time"):
        assert [c.name for c in calls] == ["get_time"], text


def test_parallel_false_allows_one_call(tiny: LoadedModel) -> None:
    for text, _, calls in calls_of(tiny, "required", parallel=False):
        assert len(calls) == 1, text


@pytest.mark.parametrize(
    ("choice", "text", "allowed"),
    [
        ("auto", "Let me check. ", True),
        (
            "auto",
            'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
            True,
        ),
        ("auto", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}', False),
        ("auto", '<tool_call>\n{"name": "launch", ', False),
        ("required", "Let me check.", False),
        ("get_time", '<tool_call>\n{"name": "get_weather", ', False),
    ],
)
def test_the_constraint_allows_text_and_valid_calls_only(
    tiny: LoadedModel, choice: str, text: str, allowed: bool
) -> None:
    """What each tool_choice lets the model write (the random model rarely writes a tag by
    chance, so the grammar is walked with the text directly): auto takes text and valid calls,
    never a call of an unknown tool or with arguments outside the schema; required and a
    named function take no text first."""
    constraint = tool_constraint(TOOLS, choice)
    assert constraint is not None
    matcher = xgrammar.GrammarMatcher(engine_for(tiny).grammars.compile(constraint))
    assert matcher.accept_string(text) is allowed


def test_none_and_no_tools_constrain_nothing() -> None:
    assert tool_constraint(TOOLS, "none") is None
    assert tool_constraint((), "auto") is None


def test_check_tools_refuses_what_no_model_could_call() -> None:
    with pytest.raises(InvalidRequest, match=r"tools\[0\].parameters: is not JSON"):
        check_tools([Tool("f", None, "{")])
    with pytest.raises(InvalidRequest, match=r"tools\[0\].parameters: a schema is an object"):
        check_tools([Tool("f", None, "[]")])
    with pytest.raises(InvalidRequest, match="at most 128"):
        check_tools([Tool(f"f{i}") for i in range(129)])
    with pytest.raises(InvalidRequest, match=r"tools\[1\].name: 'required' is a mode"):
        check_tools([Tool("f"), Tool("required")])
    string = json.dumps({"type": "string"})
    with pytest.raises(InvalidRequest, match="arguments are an object; this schema's type is"):
        check_tools([Tool("f", None, string)])


def test_read_calls_takes_calls_of_known_tools_and_leaves_the_rest() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
        "\n<tool_call>not json</tool_call>"
    )
    content, calls = read_calls(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert content is not None and content.startswith("Let me check.")
    assert '"launch"' in content and "not json" in content
    assert read_calls("plain", NAMES) == ("plain", [])
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"zo'
    assert read_calls(cut, NAMES) == (cut, [])


def test_an_argument_may_hold_the_closing_tag() -> None:
    """The grammar lets any JSON string into the arguments: the JSON is read whole."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "</tool_call>x"}}\n</tool_call>'
    content, calls = read_calls(text, NAMES)
    assert content is None
    assert [json.loads(c.arguments) for c in calls] == [{"zone": "</tool_call>x"}]


def test_content_is_the_text_around_the_calls_as_it_was() -> None:
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert read_calls(f"Let me check.\n\n{call}\n", NAMES)[0] == "Let me check.\n\n\n"
    assert read_calls(f"\n{call}\n{call}\n", NAMES)[0] is None  # calls alone


CALL_TEXT = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
)


@given(
    st.sampled_from(["", "\n", "  \n", "Sure <tool <tool_ca checking.\n\n", "x"]),
    st.sampled_from(["", "\n", "\nbye", "<tool_call>cut"]),
    st.integers(0, 2),
    st.lists(st.integers(0, 400), max_size=12),
)
def test_streamed_pieces_give_what_the_whole_text_gives(
    before: str, after: str, count: int, cuts: list[int]
) -> None:
    """Whatever comes around the calls and however the text is cut into messages, the stream's
    content is the whole answer's, character for character, and no tag leaks into it."""
    text = before + "\n".join([CALL_TEXT] * count) + after
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    held = HeldCalls(NAMES)
    streamed = "".join(held.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    rest, calls = held.finish()
    content, whole = read_calls(text, NAMES)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
    assert streamed + rest == (content or "")
    if count:
        assert CALL_TEXT not in streamed + rest


def test_a_template_without_tools_gets_them_written_into_the_turns(tiny: LoadedModel) -> None:
    assert tiny.tokenizer is not None and not tiny.tokenizer.renders_tools
    turns = plain_conversation(CONVERSATION, TOOLS)
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert "<tools>" in turns[0]["content"] and '"name": "get_weather"' in turns[0]["content"]
    assert turns[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>"
    )
    assert turns[3]["content"] == (
        '<tool_response>\n{"sky": "clear"}\n</tool_response>\n'
        '<tool_response>\n{"wind": 3}\n</tool_response>'
    )
    with_system = plain_conversation(({"role": "system", "content": "Be brief."},), TOOLS)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    rendered = tiny.tokenizer.apply_chat_template(turns)
    assert rendered.count("<|im_start|>") == 5


def test_a_vision_models_parts_stay_parts() -> None:
    """A content of parts (a vision model's turns, or text parts over gRPC): the written calls
    and the tools' description are text parts after them; a tool result's parts, its text."""
    turns = plain_conversation(
        (
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Let me look."}],
                "tool_calls": (ToolCall("get_time", '{"zone": "UTC"}', "c"),),
            },
            {"role": "tool", "content": [{"type": "text", "text": "noon"}], "tool_call_id": "c"},
        ),
        TOOLS,
    )
    assert turns[0]["role"] == "system" and "<tools>" in turns[0]["content"]
    assert turns[1]["content"][0] == {"type": "image"}
    assert turns[2]["content"][0] == {"type": "text", "text": "Let me look."}
    assert turns[2]["content"][1]["text"].startswith("\n<tool_call>\n")
    assert turns[3] == {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}


def test_a_template_with_tools_gets_them_as_transformers_passes_them(tiny: LoadedModel) -> None:
    assert tiny.tokenizer is not None
    tokenizer = Tokenizer(tiny.tokenizer.backend, eos_token="<|im_end|>", chat_template=QWEN_LIKE)
    assert tokenizer.renders_tools
    turns = template_conversation(CONVERSATION)
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    rendered = tokenizer.apply_chat_template(turns, tools=[t.as_openai() for t in TOOLS])
    assert '"description": "The forecast for a city"' in rendered
    assert '<call>get_weather {"city": "Paris", "days": 2}</call>' in rendered
    assert '<|im_start|>tool\n{"sky": "clear"}' in rendered


def prompt_tokens(
    engine: Engine, messages: tuple[dict[str, Any], ...], tools: tuple[Tool, ...]
) -> int:
    """The prompt length the engine serves a chat with."""
    recorder = Recorder()
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    request = GenerateRequest("count", messages=messages, sampling=sampling, tools=tools)
    engine.submit(request, recorder.outputs.append)
    drain(engine)
    return recorder.outputs[0].prompt_tokens


def test_the_engine_renders_tools_for_a_chat(tiny: LoadedModel) -> None:
    """The same conversation with and without tools: the tools take prompt tokens."""
    engine = engine_for(tiny)
    bare, with_tools = (prompt_tokens(engine, CONVERSATION, tools) for tools in ((), TOOLS))
    assert with_tools > bare + 50


def test_text_parts_with_tools_are_served(tiny: LoadedModel) -> None:
    """A turn sent as text parts (as gRPC's ChatPart may send one) with tools: written into a
    plain template like a string content, not a server error."""
    engine = engine_for(tiny)
    parts = ({"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},)
    assert prompt_tokens(engine, parts, TOOLS) == prompt_tokens(engine, CONVERSATION[:1], TOOLS)
