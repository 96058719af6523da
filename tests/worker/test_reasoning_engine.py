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
from worker.sampling import Sampler
from worker.sampling_params import SamplingParams, StructuredOutput
from worker.structured_output import Constraint
from worker.thinking_tokens import ThinkingTokens

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


def test_a_json_answer_waits_for_the_reasoning_the_prompt_opened(thinking: LoadedModel) -> None:
    """The grammar starts where the reasoning ends (vLLM's way): the random model reasons
    freely until its budget of 3 closes it, then writes JSON."""
    params = SamplingParams(
        max_tokens=24, temperature=0.0, separate_reasoning=True, thinking_token_budget=3,
        structured=StructuredOutput("json_object"),
    )  # fmt: skip
    outputs = run_to_end(
        engine_for(thinking), GenerateRequest("j", messages=MESSAGES, sampling=params)
    )
    reasoning, text, _ = _seen(outputs)
    ids = [t for o in outputs for t in o.token_ids]
    assert thinking.tokenizer is not None
    assert reasoning == thinking.tokenizer.decode(ids[:3]) and text.lstrip().startswith("{")


def test_a_json_answer_of_a_prompt_that_did_not_open_the_thinking_is_the_answer(
    thinking: LoadedModel,
) -> None:
    """A template that leaves the open to the model: JSON from the first token, no reasoning."""
    params = SamplingParams(
        max_tokens=12, temperature=0.0, separate_reasoning=True,
        structured=StructuredOutput("json_object"),
    )  # fmt: skip
    request = GenerateRequest(
        "j", messages=MESSAGES, sampling=params, template_variables={"model_opens": True}
    )
    reasoning, text, _ = _seen(run_to_end(engine_for(thinking), request))
    assert reasoning == "" and text.startswith("{")


def test_a_waiting_pattern_starts_after_the_close(thinking: LoadedModel) -> None:
    """Nothing of the reasoning is held to the pattern, and all of the answer is."""
    close = "</think>"
    params = SamplingParams(
        max_tokens=24, temperature=0.0, separate_reasoning=True, thinking_token_budget=2,
        structured=StructuredOutput("regex", spec="ab[a-z]{0,4}"),
    )  # fmt: skip
    outputs = run_to_end(
        engine_for(thinking), GenerateRequest("w", messages=MESSAGES, sampling=params)
    )
    reasoning, text, _ = _seen(outputs)
    assert text.startswith("ab") and close not in text + reasoning


@pytest.mark.parametrize("cut", [1, 5, 12])
def test_a_resumed_sample_resumes_its_waiting_grammar(thinking: LoadedModel, cut: int) -> None:
    """Moved before, inside or after the close: the grammar is where it was (before the cut,
    it had followed none of the reasoning)."""
    params = SamplingParams(
        max_tokens=24, temperature=0.0, separate_reasoning=True, thinking_token_budget=3,
        structured=StructuredOutput("json_object"),
    )  # fmt: skip
    whole = run_to_end(
        engine_for(thinking), GenerateRequest("w", messages=MESSAGES, sampling=params)
    )
    ids = [t for o in whole for t in o.token_ids]
    assert thinking.tokenizer is not None
    prompt = thinking.tokenizer.encode(
        thinking.tokenizer.apply_chat_template(list(MESSAGES)), add_special_tokens=False
    )
    request = GenerateRequest(
        "moved", prompt_token_ids=(*prompt, *ids[:cut]), sampling=params, resume=Resume(0, cut)
    )
    after = run_to_end(engine_for(thinking), request)
    assert ids[:cut] + [t for o in after for t in o.token_ids] == ids
    assert _seen(whole[:cut] + after) == _seen(whole)


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


@pytest.mark.parametrize(
    ("pattern", "closing", "after"),
    [
        ("ab[a-z]{0,4}", "</think>ab", "b"),
        ("ab[a-z]{0,4}", "</think>\n\nab", "b"),
        (" ab[a-z]{0,4}", "</think> ab", "b"),
        ("ab[a-z]{0,4}", "</think>,x", "a"),
    ],
    ids=["answer", "whitespace-then-answer", "answer-with-its-whitespace", "refused"],
)
def test_the_text_after_the_close_in_its_token_goes_to_the_waiting_grammar(
    thinking: LoadedModel, pattern: str, closing: str, after: str
) -> None:
    """A close written in one token with the answer's start ("x</think>ab"): the grammar
    starts after "ab" (with its leading whitespace if the grammar takes it, else without), so
    "b" may come next. Text the grammar refuses (",x") stays before the answer; the grammar
    starts fresh at the next token, which must then begin it ("a")."""
    engine = engine_for(thinking)
    assert thinking.tokenizer is not None
    grammar = engine.grammars.compile(StructuredOutput("regex", spec=pattern))
    constraint = Constraint(grammar)
    tokens = ThinkingTokens(None, (), inside=True, grammar_waits=True)
    sampler = Sampler.create(SamplingParams(), 0, constraint=constraint, thinking=tokens)
    (b,) = thinking.tokenizer.encode("b", add_special_tokens=False)
    (next_token,) = thinking.tokenizer.encode(after, add_special_tokens=False)
    assert not constraint.allows([b])  # the grammar itself begins with "a" or " a"
    sampler.follow(b)  # while reasoning, nothing reaches the grammar
    tokens.step(b, "x")
    sampler.follow(b)
    tokens.step(b, closing)
    sampler.follow(next_token)  # the grammar is given the answer's start, then takes the token
    assert constraint.allows([b]) and not constraint.complete


def test_without_the_split_a_budget_leaves_the_grammar_from_the_first_token(
    thinking: LoadedModel,
) -> None:
    """`separate_reasoning: false` keeps the text whole: the grammar does not wait (so the
    text is JSON, not reasoning and JSON), budget or not; the budget cannot force its close."""
    outputs = {}
    for budget in (None, 3):
        params = SamplingParams(
            max_tokens=12, temperature=0.0, thinking_token_budget=budget,
            structured=StructuredOutput("json_object"),
        )  # fmt: skip
        request = GenerateRequest("j", messages=MESSAGES, sampling=params)
        outputs[budget] = _seen(run_to_end(engine_for(thinking), request))
    assert outputs[None] == outputs[3] and outputs[3][1].startswith("{")
