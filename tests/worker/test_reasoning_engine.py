"""A thinking model's reasoning told from its answer by the engine (`separate_reasoning`): the
output's `reasoning_text` and `text`, streamed, for each way a template starts the thinking;
a resumed sample goes on where its split was; other models and other requests are untouched.
The generated text is forced with a structured `choice`, so the tiny model writes the tags."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.helpers import run_to_end
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.request import FINISH_LENGTH, FINISH_STOP, GenerateRequest, RequestOutput, Resume
from worker.sampling_params import SamplingParams, StructuredOutput

MESSAGES = ({"role": "user", "content": "Which city?"},)


def engine_for(loaded: LoadedModel) -> Engine:
    config = EngineConfig(num_pages=256, page_size=4, model_revision=loaded.revision)
    return Engine(loaded.model, loaded.tokenizer, config)


def sampling(choice: str, separate: bool = True, **more: Any) -> SamplingParams:
    forced = StructuredOutput("choice", choices=(choice,))
    settings = {"max_tokens": 64, "temperature": 0.0, **more}
    return SamplingParams(structured=forced, separate_reasoning=separate, **settings)


def chat(
    loaded: LoadedModel, params: SamplingParams, **variables: Any
) -> tuple[str, str, str | None]:
    request = GenerateRequest(
        "r", messages=MESSAGES, sampling=params, template_variables=variables or None
    )
    outputs = run_to_end(engine_for(loaded), request)
    return _seen(outputs)


def _seen(outputs: list[RequestOutput]) -> tuple[str, str, str | None]:
    return (
        "".join(o.reasoning_text for o in outputs),
        "".join(o.text for o in outputs),
        outputs[-1].finish_reason,
    )


def test_a_prompt_that_opens_the_thinking_leaves_the_close_to_the_model(
    thinking: LoadedModel,
) -> None:
    assert chat(thinking, sampling("it rains</think>Paris")) == ("it rains", "Paris", FINISH_STOP)


def test_a_model_that_opens_its_own_thinking(thinking: LoadedModel) -> None:
    got = chat(thinking, sampling("<think>rain</think>\n\nParis"), model_opens=True)
    assert got == ("rain", "\n\nParis", FINISH_STOP)


@pytest.mark.parametrize(
    ("choice", "opens"), [("<think>rain</think>\n\nParis", True), ("it rains</think>Paris", False)]
)
def test_the_reasoning_tokens_run_from_the_open_to_the_close(
    thinking: LoadedModel, choice: str, opens: bool
) -> None:
    """Counted for the usage: every token from the model's `<think>` (or the first, when the
    prompt opened it) to the one that completes `</think>`; none after."""
    request = GenerateRequest(
        "c", messages=MESSAGES, sampling=sampling(choice),
        template_variables={"model_opens": True} if opens else None,
    )  # fmt: skip
    outputs = run_to_end(engine_for(thinking), request)
    ids = [t for o in outputs for t in o.token_ids]
    assert thinking.tokenizer is not None
    closing = next(
        k for k in range(len(ids) + 1) if "</think>" in thinking.tokenizer.decode(ids[:k])
    )
    counts = [o.reasoning_tokens for o in outputs]
    assert sum(counts) == closing and not any(counts[closing:])
    assert all(counts[:closing]) or opens  # the model's `<think>`, several tokens, counts whole


def test_thinking_switched_off_is_all_answer(thinking: LoadedModel) -> None:
    assert chat(thinking, sampling("Paris"), enable_thinking=False) == ("", "Paris", FINISH_STOP)


def test_a_sample_cut_before_the_close_is_all_reasoning(thinking: LoadedModel) -> None:
    reasoning, text, reason = chat(thinking, sampling("rain and wind</think>Paris", max_tokens=4))
    assert (text, reason) == ("", FINISH_LENGTH)
    assert reasoning and "rain and wind".startswith(reasoning)


def test_without_the_flag_or_without_a_thinking_model_the_text_is_whole(
    thinking: LoadedModel, tiny: LoadedModel
) -> None:
    assert chat(thinking, sampling("rain</think>Paris", separate=False)) == (
        "", "rain</think>Paris", FINISH_STOP,
    )  # fmt: skip
    assert chat(tiny, sampling("<think>rain</think>Paris")) == (
        "", "<think>rain</think>Paris", FINISH_STOP,
    )  # fmt: skip


@pytest.mark.parametrize("where", ["first", "reasoning", "answer", "last"])
def test_a_resumed_sample_goes_on_where_its_split_was(thinking: LoadedModel, where: str) -> None:
    """The router's move of a stream to another worker: the first messages of a whole run and
    then the resumed stream read as the whole run does, cut in the reasoning or in the answer."""
    params = sampling("it rains today</think>Paris, France")
    whole = run_to_end(
        engine_for(thinking), GenerateRequest("w", messages=MESSAGES, sampling=params)
    )
    answering = next(i for i, o in enumerate(whole) if o.text)  # the first with answer text
    cut = {"first": 1, "reasoning": answering - 1, "answer": answering + 1, "last": len(whole) - 1}
    assert 0 < cut[where] < len(whole) and answering > 2
    assert thinking.tokenizer is not None
    prompt = thinking.tokenizer.encode(
        thinking.tokenizer.apply_chat_template(list(MESSAGES)), add_special_tokens=False
    )
    before = whole[: cut[where]]
    tokens = [t for o in before for t in o.token_ids]
    request = GenerateRequest(
        "moved", prompt_token_ids=(*prompt, *tokens), sampling=params, resume=Resume(0, len(tokens))
    )
    after = run_to_end(engine_for(thinking), request)
    assert _seen(before + after) == _seen(whole) == ("it rains today", "Paris, France", FINISH_STOP)


def test_every_sample_of_n_is_split(thinking: LoadedModel) -> None:
    params = sampling("x</think>y", n=3, temperature=1.0, seed=7)  # one choice: one text
    outputs = run_to_end(
        engine_for(thinking), GenerateRequest("n", messages=MESSAGES, sampling=params)
    )
    for index in range(3):
        assert _seen([o for o in outputs if o.index == index]) == ("x", "y", FINISH_STOP)


def test_a_tag_quoted_by_the_user_opens_no_reasoning(thinking: LoadedModel) -> None:
    quoted = ({"role": "user", "content": "What does <think> do?"},)
    params = sampling("It opens; </think> closes.")  # the answer quotes the close tag too
    request = GenerateRequest(
        "q", messages=quoted, sampling=params, template_variables={"model_opens": True}
    )
    got = _seen(run_to_end(engine_for(thinking), request))
    assert got == ("", "It opens; </think> closes.", FINISH_STOP)


def test_a_json_answer_is_the_answer_though_the_prompt_opened_the_thinking(
    thinking: LoadedModel,
) -> None:
    """Constrained from its first token, a JSON answer cannot close a reasoning it is not in."""
    params = SamplingParams(
        max_tokens=12, temperature=0.0, separate_reasoning=True,
        structured=StructuredOutput("json_object"),
    )  # fmt: skip
    outputs = run_to_end(
        engine_for(thinking), GenerateRequest("j", messages=MESSAGES, sampling=params)
    )
    reasoning, text, _ = _seen(outputs)
    assert reasoning == "" and text.startswith("{")


def test_a_turns_reasoning_counts_against_the_prompt_characters(thinking: LoadedModel) -> None:
    config = EngineConfig(num_pages=64, page_size=4, max_prompt_chars=200)
    engine = Engine(thinking.model, thinking.tokenizer, config)
    turns = (
        *MESSAGES,
        {"role": "assistant", "content": "Paris", "reasoning_content": "x" * 300},
        {"role": "user", "content": "Why?"},
    )
    with pytest.raises(InvalidRequest, match="messages"):
        engine.submit(GenerateRequest("long", messages=turns), lambda _: None)
    short = (*turns[:1], {**turns[1], "reasoning_content": "x"}, turns[2])
    engine.submit(GenerateRequest("short", messages=short), lambda _: None)
