"""A chat's last message continued (worker/chat_continuation.py): with SmolLM2's and the tiny
model's real templates, a continued assistant turn is exactly the conversation's generation
prompt followed by the message's text, whatever the text (even one that the end-of-turn token
contains, as "i" is in `<|im_end|>`); what cannot be continued is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.worker.tokenizer_fixtures import TOKENIZERS
from worker.chat_continuation import MARK, continued, final_text
from worker.errors import InvalidRequest
from worker.tokenizer import Tokenizer

ASKED = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
]
PREFILLS = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1
).filter(lambda t: bool(t.strip()))
LOADED = {name: make() for name, make in sorted(TOKENIZERS.items())}


def closed(tokenizer: Tokenizer) -> Callable[[list[dict[str, Any]]], str]:
    """The template without a generation prompt, as a request that continues renders it."""
    return lambda chat: tokenizer.apply_chat_template(chat, add_generation_prompt=False)


@given(prefill=st.one_of(PREFILLS, st.sampled_from(["i", "m", "_", "end", "|>", "a\n", "a "])))
def test_a_continued_turn_is_the_generation_prompt_then_the_text(prefill: str) -> None:
    for name, tokenizer in LOADED.items():
        opened = tokenizer.apply_chat_template(ASKED)  # ends with the generation prompt
        chat = [*ASKED, {"role": "assistant", "content": prefill}]
        assert continued(closed(tokenizer), chat) == opened + prefill, name


@pytest.mark.parametrize("name", sorted(LOADED))
def test_text_parts_are_continued_as_their_text(name: str) -> None:
    tokenizer = LOADED[name]
    parts: list[dict[str, Any]] = [
        {"type": "text", "text": "Par"},
        {"type": "text", "text": "is is"},
    ]
    assert final_text({"role": "assistant", "content": parts}) == "Paris is"
    render = tokenizer.apply_chat_template
    as_text = [*ASKED, {"role": "assistant", "content": "Paris is"}]
    as_parts = [*ASKED, {"role": "assistant", "content": parts}]

    def joined(chat: list[dict[str, Any]]) -> str:  # a text model's template takes the text
        flat = [{**m, "content": final_text(m)} for m in chat]
        return render(flat, add_generation_prompt=False)

    assert continued(joined, as_parts) == continued(closed(tokenizer), as_text)


@pytest.mark.parametrize(
    ("content", "why"),
    [("", "empty"), ("   \n", "empty"), (f"a{MARK}", "mark")],
)
def test_what_cannot_be_continued_is_refused(content: str, why: str) -> None:
    chat = [*ASKED, {"role": "assistant", "content": content}]
    with pytest.raises(InvalidRequest) as refused:
        continued(closed(LOADED["tiny"]), chat)
    assert refused.value.field == "messages" and why in str(refused.value)


def test_a_template_that_drops_the_text_is_refused() -> None:
    chat = [*ASKED, {"role": "assistant", "content": "Paris"}]
    with pytest.raises(InvalidRequest) as refused:
        continued(lambda messages: "<|im_start|>assistant\nPARIS<|im_end|>\n", chat)
    assert "does not write the last message's text" in str(refused.value)
