"""A thinking model's reasoning cut at `thinking_token_budget` (worker/thinking_tokens.py): the
close forced after exactly that many reasoning tokens, from the prompt's `<think>` or the
model's own; never where the model closed it first, nor on a model that does not think; under a
grammar that allows it, forced as without one; a grammar that does not allow it, or
`min_tokens` holding one of its tokens back, decides instead; a resumed sample forces the rest
of a close it was cut in. The tiny model writes random tokens, so only the budget closes its
reasoning (unless a structured output makes it write the tags)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from protos.radixmesh.v1 import serving_pb2
from tests.worker.helpers import drain, run_to_end
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.reasoning import CLOSE
from worker.request import FINISH_LENGTH, GenerateRequest, RequestOutput, Resume
from worker.sampling_params import SamplingParams, StructuredOutput
from worker.thinking_tokens import ThinkingTokens
from worker.tiny_model import TINY_CONFIG, tiny_model
from worker.wire import sampling_from_proto, sampling_to_proto

MESSAGES = ({"role": "user", "content": "Which city?"},)
CLOSE_IDS = (7, 8)


def engine_for(loaded: LoadedModel) -> Engine:
    config = EngineConfig(num_pages=256, page_size=4, model_revision=loaded.revision)
    return Engine(loaded.model, loaded.tokenizer, config)


def close_ids(loaded: LoadedModel) -> list[int]:
    assert loaded.tokenizer is not None
    return loaded.tokenizer.encode(CLOSE, add_special_tokens=False)


def generate(
    loaded: LoadedModel, separate: bool = True, request_id: str = "r", **more: Any
) -> list[RequestOutput]:
    settings = {"max_tokens": 24, "temperature": 0.0, "separate_reasoning": separate, **more}
    variables = settings.pop("variables", None)
    request = GenerateRequest(
        request_id, messages=MESSAGES, sampling=SamplingParams(**settings),
        template_variables=variables,
    )  # fmt: skip
    return run_to_end(engine_for(loaded), request)


def tokens(outputs: Sequence[RequestOutput], index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def texts(outputs: Sequence[RequestOutput], index: int = 0) -> tuple[str, str]:
    mine = [o for o in outputs if o.index == index]
    return "".join(o.reasoning_text for o in mine), "".join(o.text for o in mine)


# the budget alone, on made-up tokens: (token, text) steps


def feed(budget: ThinkingTokens, steps: Sequence[tuple[int, str]]) -> list[int | None]:
    """What the budget forced before each step, each step taking the forced token if any."""
    seen = []
    for drawn, its_text in steps:
        forced = budget.forced
        seen.append(forced)
        if forced is None:
            budget.step(drawn, its_text)
        else:
            budget.step(forced, {7: "</th", 8: "ink>"}[forced])
    return seen


def test_the_close_is_forced_after_the_budget_from_the_prompts_open() -> None:
    budget = ThinkingTokens(3, CLOSE_IDS, inside=True)
    got = feed(budget, [(1, "a"), (2, "b"), (3, "c"), (0, ""), (0, ""), (4, "x")])
    assert got == [None, None, None, 7, 8, None]
    assert (budget.used, budget.split.reasoning) == (3, False)


def test_the_models_own_open_is_not_counted() -> None:
    budget = ThinkingTokens(2, CLOSE_IDS, inside=False)
    got = feed(budget, [(5, " <think>"), (1, "a"), (2, "b"), (0, ""), (0, "")])
    assert got == [None, None, None, 7, 8]


def test_an_answer_that_never_opened_is_never_forced() -> None:
    budget = ThinkingTokens(0, CLOSE_IDS, inside=False)
    assert feed(budget, [(1, "Paris"), (2, " <think>"), (3, "x")]) == [None, None, None]


def test_a_close_the_model_wrote_first_ends_the_count() -> None:
    budget = ThinkingTokens(3, CLOSE_IDS, inside=True)
    assert feed(budget, [(1, "a</think>"), (2, "b"), (3, "c"), (4, "d")]) == [None] * 4
    assert budget.used == 0


def test_budget_zero_forces_the_first_token() -> None:
    assert ThinkingTokens(0, CLOSE_IDS, inside=True).forced == 7


def test_a_token_other_than_the_forced_one_gives_the_forcing_up() -> None:
    budget = ThinkingTokens(1, CLOSE_IDS, inside=True)
    budget.step(1, "a")
    assert budget.forced == 7
    budget.step(3, "c")  # drawn instead
    assert budget.forced is None
    budget.step(4, "d")
    assert budget.forced is None  # it forces once


def test_without_a_budget_it_only_counts() -> None:
    counting = ThinkingTokens(None, (), inside=True)
    counts = [counting.step(1, piece) for piece in ["a", "b", "</th", "ink>", "c"]]
    assert counts == [1, 1, 1, 1, 0] and counting.forced is None


@given(
    st.integers(0, 6),
    st.lists(st.sampled_from(["a", "b ", " ", "\n", "<", "</", "</think>", "x</think>y"])),
)
def test_forced_exactly_when_the_reasoning_reaches_the_budget(
    budget: int, pieces: list[str]
) -> None:
    """Against a plain count: the close is forced at the first step where `budget` pieces have
    gone by inside a reasoning not yet closed (the prompt opened it), and at no other."""
    counted = ThinkingTokens(budget, CLOSE_IDS, inside=True)
    forced_at = None
    for step, piece in enumerate([*pieces, ""]):
        if counted.forced is not None:
            forced_at = step
            break
        counted.step(1, piece)
    expected, used = None, 0
    for step in range(len(pieces) + 1):
        if CLOSE in "".join(pieces[:step]):
            break
        if used >= budget:
            expected = step
            break
        used += CLOSE not in "".join(pieces[: step + 1])
    assert forced_at == expected


# the engine, on the tiny thinking model


def test_the_reasoning_is_closed_after_exactly_the_budget(thinking: LoadedModel) -> None:
    close = close_ids(thinking)
    outputs = generate(thinking, thinking_token_budget=5)
    generated = tokens(outputs)
    assert generated[5 : 5 + len(close)] == close
    assert thinking.tokenizer is not None
    reasoning, answer = texts(outputs)
    assert reasoning == thinking.tokenizer.decode(generated[:5])
    assert answer == thinking.tokenizer.decode(generated[5 + len(close) :])
    assert outputs[-1].finish_reason == FINISH_LENGTH and len(generated) == 24
    assert sum(o.reasoning_tokens for o in outputs) == 5 + len(
        close
    )  # the close is the reasoning's


def test_without_separating_the_text_holds_the_forced_close(thinking: LoadedModel) -> None:
    close = close_ids(thinking)
    outputs = generate(thinking, separate=False, thinking_token_budget=4)
    generated = tokens(outputs)
    assert generated[4 : 4 + len(close)] == close
    reasoning, text = texts(outputs)
    assert reasoning == "" and CLOSE in text


def test_budget_zero_closes_at_once_and_the_answer_follows(thinking: LoadedModel) -> None:
    close = close_ids(thinking)
    outputs = generate(thinking, thinking_token_budget=0)
    assert tokens(outputs)[: len(close)] == close
    reasoning, answer = texts(outputs)
    assert reasoning == "" and answer


REASONING_THEN_ANSWER = "[a-z ]{0,30}</think>[a-z]{1,5}"
"""A grammar that lets the model reason in a few letters, close when it likes, and answer."""


def test_under_a_grammar_that_allows_the_close_it_is_forced_all_the_same(
    thinking: LoadedModel,
) -> None:
    close = close_ids(thinking)
    grammar = StructuredOutput("regex", spec=REASONING_THEN_ANSWER)
    outputs = generate(thinking, thinking_token_budget=3, structured=grammar, max_tokens=64)
    generated = tokens(outputs)
    assert generated[3 : 3 + len(close)] == close
    reasoning, answer = texts(outputs)
    assert thinking.tokenizer is not None
    assert reasoning == thinking.tokenizer.decode(generated[:3]) and answer.isalpha()


def test_the_models_own_thinking_is_counted_from_its_open(thinking: LoadedModel) -> None:
    """A template that leaves the open to the model: the grammar makes it write `<think>`, and
    the budget counts from the token after it."""
    close = close_ids(thinking)
    grammar = StructuredOutput("regex", spec="<think>" + REASONING_THEN_ANSWER)
    outputs = generate(
        thinking, thinking_token_budget=2, structured=grammar, variables={"model_opens": True},
        max_tokens=64,
    )  # fmt: skip
    generated = tokens(outputs)
    assert thinking.tokenizer is not None
    opened = next(
        k for k in range(len(generated)) if thinking.tokenizer.decode(generated[:k]) == "<think>"
    )
    assert generated[opened + 2 : opened + 2 + len(close)] == close
    reasoning, _ = texts(outputs)
    assert reasoning == thinking.tokenizer.decode(generated[opened : opened + 2])


def test_a_grammar_that_does_not_allow_the_close_decides(thinking: LoadedModel) -> None:
    """The choice's first letters are fixed: the close cannot come after 2 tokens, and the
    sample writes the choice as it would without a budget."""
    forced = StructuredOutput("choice", choices=("abcdefgh</think>Paris",))
    outputs = generate(thinking, thinking_token_budget=2, structured=forced, max_tokens=64)
    assert texts(outputs) == ("abcdefgh", "Paris")


def test_min_tokens_holding_a_token_of_the_close_back_decides(thinking: LoadedModel) -> None:
    """A close token that would stop the sample (a stop token id) before min_tokens: the
    budget gives up rather than end the sample early."""
    close = close_ids(thinking)
    outputs = generate(thinking, thinking_token_budget=3, min_tokens=20, stop_token_ids=(close[0],))
    generated = tokens(outputs)
    assert len(generated) >= 20 and generated[3 : 3 + len(close)] != close


def test_a_budget_the_model_stays_under_changes_nothing(thinking: LoadedModel) -> None:
    """The grammar closes the reasoning within 30 letters: a budget of 40 never forces."""
    grammar = StructuredOutput("regex", spec=REASONING_THEN_ANSWER)
    with_budget = generate(thinking, thinking_token_budget=40, structured=grammar, max_tokens=64)
    without = generate(thinking, structured=grammar, max_tokens=64)
    assert tokens(with_budget) == tokens(without)
    assert texts(without)[1]  # the model closed its reasoning and answered


def test_a_model_that_does_not_think_has_no_budget(tiny: LoadedModel) -> None:
    assert tokens(generate(tiny, thinking_token_budget=2)) == tokens(generate(tiny))


def test_every_sample_of_n_has_its_own_budget(thinking: LoadedModel) -> None:
    close = close_ids(thinking)
    outputs = generate(thinking, thinking_token_budget=3, n=3, temperature=1.0, seed=11)
    for index in range(3):
        assert tokens(outputs, index)[3 : 3 + len(close)] == close


@pytest.mark.parametrize("cut", [2, 6, 9, 13])
def test_a_resumed_sample_forces_what_is_left_of_the_close(thinking: LoadedModel, cut: int) -> None:
    """The router's move of a stream to another worker, cut before the budget, inside the
    forced close (6: after its first token, when it has several) or after it."""
    close = close_ids(thinking)
    whole_outputs = generate(thinking, thinking_token_budget=5)
    whole = tokens(whole_outputs)
    assert thinking.tokenizer is not None
    prompt = thinking.tokenizer.encode(
        thinking.tokenizer.apply_chat_template(list(MESSAGES)), add_special_tokens=False
    )
    cut = min(cut, 5 + len(close))
    request = GenerateRequest(
        "moved",
        prompt_token_ids=(*prompt, *whole[:cut]),
        sampling=SamplingParams(
            max_tokens=24, temperature=0.0, thinking_token_budget=5, separate_reasoning=True
        ),
        resume=Resume(0, cut),
    )
    resumed = run_to_end(engine_for(thinking), request)
    after = tokens(resumed)
    assert whole[:cut] + after == whole and whole[5 : 5 + len(close)] == close
    counted = sum(o.reasoning_tokens for o in whole_outputs[:cut] + resumed)
    assert counted == sum(o.reasoning_tokens for o in whole_outputs) == 5 + len(close)


@pytest.mark.parametrize("budget", [-1, True, 2**31])
def test_a_budget_out_of_range_is_refused_by_name(thinking: LoadedModel, budget: int) -> None:
    engine = engine_for(thinking)
    request = GenerateRequest(
        "bad", messages=MESSAGES, sampling=SamplingParams(thinking_token_budget=budget)
    )
    with pytest.raises(InvalidRequest, match="thinking_token_budget"):
        engine.submit(request, lambda _: None)


@pytest.mark.parametrize("budget", [None, 0, 4096])
def test_the_budget_survives_the_wire(budget: int | None) -> None:
    params = SamplingParams(thinking_token_budget=budget, separate_reasoning=True)
    data = sampling_to_proto(params).SerializeToString()
    assert sampling_from_proto(serving_pb2.SamplingParams.FromString(data)) == params


def test_the_reasoning_tokens_do_not_wait_for_the_stop_strings(thinking: LoadedModel) -> None:
    """A stop string that could begin with the close's end (">Q") holds its text back a token;
    the count is read from the text before the stop strings, so it does not change."""
    forced = StructuredOutput("choice", choices=("rain</think>Paris",))
    plain = generate(thinking, structured=forced, max_tokens=64)
    held = generate(thinking, structured=forced, max_tokens=64, stop=(">Q",))
    assert tokens(plain) == tokens(held) and texts(plain) == texts(held) == ("rain", "Paris")
    counts = [o.reasoning_tokens for o in held]
    assert counts == [o.reasoning_tokens for o in plain] and 0 < sum(counts) < len(counts)


def test_a_prompt_with_ids_past_the_tokenizers_is_served(thinking: LoadedModel) -> None:
    """A model's vocabulary may be padded past its tokenizer's (Qwen3's 151,936 ids of
    151,669), and a prompt may hold such an id, as vLLM takes it. Whether the prompt opened
    the reasoning is read from the tokens after the last such id: a prompt ending with one
    did not open it (nothing forced, all of the text the answer); one whose `<think>`
    follows it did (the close forced at the budget). Neither fails, nor keeps its id."""
    tokenizer = thinking.tokenizer
    assert tokenizer is not None
    padded = tokenizer.vocab_size  # a valid id of the model's that the tokenizer cannot decode
    model = tiny_model(dataclasses.replace(TINY_CONFIG, vocab_size=padded + 64), seed=1)
    engine = Engine(model, tokenizer, EngineConfig(num_pages=64, page_size=4, max_model_len=64))
    opens = tokenizer.encode("<think>\n", add_special_tokens=False)
    sampling = SamplingParams(
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        separate_reasoning=True,
        thinking_token_budget=3,
        allowed_token_ids=tuple(range(padded)),  # what the tokenizer can write
    )
    outputs: list[RequestOutput] = []
    for request_id, prompt in (("ends", (5, 6, padded)), ("opens", (5, padded, *opens))):
        request = GenerateRequest(request_id, prompt, sampling=sampling)
        assert engine.submit(request, outputs.append) == len(prompt)
    drain(engine)
    for request_id in ("ends", "opens"):
        mine = [o for o in outputs if o.request_id == request_id]
        assert (mine[-1].finish_reason, mine[-1].error) == (FINISH_LENGTH, None), request_id
        assert len(tokens(mine)) == 12
    ended = [o for o in outputs if o.request_id == "ends"]
    assert texts(ended)[0] == "" and sum(o.reasoning_tokens for o in ended) == 0
    opened = [o for o in outputs if o.request_id == "opens"]
    assert tokens(opened)[3 : 3 + len(close_ids(thinking))] == close_ids(thinking)
    assert texts(opened)[0] == tokenizer.decode(tokens(opened)[:3])
    assert not engine.active_requests and engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)
