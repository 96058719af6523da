"""worker/reasoning.py: a thinking model's text split into reasoning and content, the same
whatever pieces it streams in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.reasoning import (
    CLOSE,
    OPEN,
    ReasoningSplit,
    may_hold_reasoning,
    prompt_opens,
    split_reasoning,
    template_thinks,
)
from worker.sampling_params import StructuredOutput
from worker.tool_calls import Tool, tool_constraint

PIECES = st.sampled_from(
    [OPEN, CLOSE, "<", "</", "<th", "</thi", "think>", "nk>", " ", "\n", "a", "b c", "é", "<b>"]
)


def reference(text: str, inside: bool) -> tuple[str, str]:
    """The rule, read off the whole text at once."""
    head = text.lstrip()
    if head.startswith(OPEN):
        body = head[len(OPEN) :]
    elif inside:
        body = text
    else:
        return "", text
    at = body.find(CLOSE)
    return (body, "") if at < 0 else (body[:at], body[at + len(CLOSE) :])


@given(st.lists(PIECES, max_size=12), st.booleans(), st.data())
def test_any_pieces_stream_the_split_of_the_whole_text(
    pieces: list[str], inside: bool, data: st.DataObject
) -> None:
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    split, reasoning, content = ReasoningSplit(inside), "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = split.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = split.flush()
    assert (reasoning + r, content + c) == reference(text, inside) == split_reasoning(text, inside)


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        # Qwen3's first template: the model opens and closes its thinking
        (
            "<think>\nThe user greets.\n</think>\n\nHello!",
            False,
            ("\nThe user greets.\n", "\n\nHello!"),
        ),
        # DeepSeek-R1's: the prompt opened it; only the close is generated
        ("Nine is more.\n</think>\n\n9.8", True, ("Nine is more.\n", "\n\n9.8")),
        # a thinking template with thinking switched off: no tags, all content
        ("Hello!", False, ("", "Hello!")),
        # cut by max_tokens before the close: reasoning to the end
        ("<think>\nStill thinking", False, ("\nStill thinking", "")),
        # after the close, a quoted tag is content
        ("<think>x</think>Use <think> and </think>.", False, ("x", "Use <think> and </think>.")),
        # a tag after other text does not open reasoning
        ("Answer: <think>no</think>", False, ("", "Answer: <think>no</think>")),
        # the prompt opened it and the model opened it again: the second tag is dropped
        ("<think>r</think>c", True, ("r", "c")),
    ],
)
def test_the_shapes_thinking_models_write(
    text: str, inside: bool, expected: tuple[str, str]
) -> None:
    assert split_reasoning(text, inside) == expected


def test_a_tag_cut_across_messages_is_held_until_whole() -> None:
    split = ReasoningSplit(inside=True)
    assert split.feed("because</th") == ("because", "")
    assert split.feed("ink>\n\nYes") == ("", "\n\nYes")
    assert split.flush() == ("", "")


def test_the_prompt_decides_where_the_sample_starts() -> None:
    assert prompt_opens("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not prompt_opens("<|im_start|>assistant\n")
    # a tag quoted in the user's turn opens nothing
    assert not prompt_opens("What does <think> do?<|im_end|>\n<|im_start|>assistant\n")
    assert template_thinks("{{ content.split('</think>')[-1] }}")
    assert not template_thinks("{{ messages }}") and not template_thinks(None)


def test_a_constraint_from_the_first_token_holds_no_reasoning() -> None:
    tools = [Tool("f", None, '{"type": "object"}')]
    assert may_hold_reasoning(None)
    assert may_hold_reasoning(tool_constraint(tools, "auto"))  # free text may come first
    assert not may_hold_reasoning(tool_constraint(tools, "required"))
    assert not may_hold_reasoning(tool_constraint(tools, "f"))
    assert not may_hold_reasoning(StructuredOutput("json_object"))
    assert not may_hold_reasoning(StructuredOutput("json_schema", '{"type": "object"}'))
    assert not may_hold_reasoning(StructuredOutput("choice", choices=("yes", "no")))
    assert may_hold_reasoning(StructuredOutput("choice", choices=("a</think>b",)))
    assert may_hold_reasoning(StructuredOutput("regex", "[a-z]+</think>[A-Z]+"))
    assert not may_hold_reasoning(StructuredOutput("regex", "[a-z]+"))


@given(st.lists(PIECES, max_size=12), st.booleans())
def test_the_reasoning_tokens_are_those_up_to_the_close(pieces: list[str], inside: bool) -> None:
    """Each piece a token: the counts add up to the tokens from the first (when the reasoning
    is opened by the prompt or by the model's own `<think>`) to the one completing `</think>`,
    or to the end if it never closes; to none when the text is all answer."""
    split = ReasoningSplit(inside)
    counts = [split.feed_token(piece)[2] for piece in pieces]
    text = "".join(pieces)
    opened = inside or text.lstrip().startswith(OPEN)
    head = text.lstrip()
    undecided = not inside and OPEN.startswith(head) and head != OPEN  # its text: the answer
    if not opened or undecided:
        assert sum(counts) == 0
        return
    after_open = len(text) - len(head) + len(OPEN) if head.startswith(OPEN) else 0
    close = text.find(CLOSE, after_open)
    if close < 0:
        assert sum(counts) == len(pieces)
    else:
        ends = [len("".join(pieces[: i + 1])) for i in range(len(pieces))]
        closing = next(i for i, end in enumerate(ends) if end >= close + len(CLOSE))
        assert sum(counts) == closing + 1 and not any(counts[closing + 1 :])
