"""Predicted outputs (OpenAI's `prediction`, worker/predicted_output.py): a prediction changes
how many steps a sample takes, never what it generates, and the usage says what the prediction
was worth: the cursor and the draft check on token lists, then the tiny model's engine with and
without a prediction, token for token."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from tests.worker.helpers import Recorder, drain
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.predicted_output import (
    PredictedOutput,
    PredictionCheck,
    PredictionCursor,
    predicted_output,
)
from worker.request import GenerateRequest
from worker.sampling_params import MAX_PREDICTION_CHARS, SamplingParams

PROMPT = "the quick brown"


# -- the cursor ---------------------------------------------------------------------------------


def _cursor(prediction: Sequence[int], written: Sequence[int] = ()) -> PredictionCursor:
    return PredictionCursor(PredictedOutput(prediction, 2, 8), written)


def test_a_cursor_that_follows_proposes_what_comes_next() -> None:
    cursor = _cursor([10, 11, 12, 13, 14, 15])
    tokens = [1, 2, 3]  # the prompt: nothing is followed before the output
    assert cursor.propose(tokens, 4) == [10, 11, 12, 13]
    for token in (10, 11):
        assert cursor.follow(token)
        tokens.append(token)
    assert cursor.propose(tokens, 10) == [12, 13, 14, 15]
    for token in (12, 13, 14, 15):
        assert cursor.follow(token)
    assert cursor.propose([*tokens, 12, 13, 14, 15], 4) == []  # used up
    assert not cursor.follow(16)


def test_a_lost_cursor_realigns_where_the_output_rejoins_the_prediction() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    cursor = _cursor(prediction)
    written = [10, 11, 99, 98, 13, 14]  # an edit, then the prediction again from 13
    followed = [cursor.follow(token) for token in written]
    assert followed == [True, True, False, False, False, False]
    assert cursor.propose([0, *written], 3) == [15, 16, 17]
    assert cursor.follow(15) and cursor.follow(16)
    # its last tokens nowhere in the prediction: nothing to propose, until they are
    assert not cursor.follow(77)
    assert cursor.propose([0, *written, 15, 16, 77], 3) == []
    assert not cursor.follow(17)
    assert cursor.propose([0, *written, 15, 16, 77, 17], 3) == []  # (77, 17) occurs nowhere
    assert not cursor.follow(18)
    assert cursor.propose([0, *written, 15, 16, 77, 17, 18], 3) == []  # 18 has nothing after


def test_realigning_prefers_the_longest_match_then_the_place_after_the_cursor() -> None:
    # (5, 6) occurs three times; only the last is preceded by 4
    prediction = [5, 6, 1, 5, 6, 2, 4, 5, 6, 3]
    cursor = _cursor(prediction)
    assert not cursor.follow(9)
    assert cursor.propose([4, 5, 6], 1) == [3]
    # equally long matches: the first at or after where the cursor last was
    cursor = _cursor(prediction, [5, 6, 1])  # followed to position 3
    assert not cursor.follow(8)
    assert cursor.propose([8, 5, 6], 1) == [2]


def test_a_resumed_sample_follows_what_it_wrote_before() -> None:
    cursor = _cursor([10, 11, 12, 13], written=[10, 11])
    assert cursor.propose([1, 10, 11], 5) == [12, 13]


@settings(max_examples=300, deadline=None)
@given(
    prediction=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    output=st.lists(st.integers(0, 5), min_size=1, max_size=40),
)
def test_a_proposal_is_always_a_piece_of_the_prediction_after_the_output(
    prediction: list[int], output: list[int]
) -> None:
    """Whatever the output, a cursor follows it exactly where the prediction has its tokens in
    place, and a proposal is the run of the prediction after a place the output's last token
    ends (its last two, when the cursor was lost and realigned)."""
    cursor = _cursor(prediction)
    for i, token in enumerate(output):
        was = cursor.at
        assert cursor.follow(token) == (was is not None and prediction[was : was + 1] == [token])
        lost = cursor.at is None
        draft = cursor.propose(output[: i + 1], 4)
        at = cursor.at
        if not draft:
            assert at is None or at == len(prediction)
            continue
        assert at is not None and draft == prediction[at : at + 4]
        assert prediction[at - 1] == token
        if lost:
            assert prediction[at - 2 : at] == output[i - 1 : i + 1]


# -- the draft check ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drawn", "ends_at", "expected"),
    [
        ([1, 2, 3, 9], None, [0, 0, 0, 0]),  # the whole draft, then the token after it
        ([1, 7], None, [0, 2]),  # the second differs: it and the third were computed in vain
        ([8], None, [3]),
        ([1, 2], 1, [0, 1]),  # the sample ends at the second token: the third is never drawn
        ([1, 2, 3], 2, [0, 0, 0]),
    ],
)
def test_the_draft_check_counts_what_a_draft_left_undrawn(
    drawn: list[int], ends_at: int | None, expected: list[int]
) -> None:
    check = PredictionCheck([1, 2, 3], at=10)
    counted = [check.rejected(10 + i, t, ended=i == ends_at) for i, t in enumerate(drawn)]
    assert counted == expected
    assert check.rejected(10 + len(drawn), 1, ended=False) == 0  # settled: nothing more


# -- the engine ---------------------------------------------------------------------------------


def _words(tiny: LoadedModel) -> tuple[int, ...]:
    """Tokens that each spell a space and a lowercase word, and spell back to themselves: any
    run of them decodes to text that tokenizes back to the run."""
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    return tuple(
        t
        for t in range(tiny.config.vocab_size)
        if re.fullmatch(r" [a-z]+", text := tokenizer.decode([t]))
        and tokenizer.encode(text, add_special_tokens=False) == [t]
    )


def _engine(tiny: LoadedModel, **config: Any) -> Engine:
    values: dict[str, Any] = {"num_pages": 256, "page_size": 4, "model_revision": tiny.revision}
    return Engine(tiny.model, tiny.tokenizer, EngineConfig(**(values | config)))


def _run(engine: Engine, *requests: GenerateRequest) -> tuple[Recorder, int]:
    """Every output of `requests` and the steps the engine took; every page accounted for."""
    recorder = Recorder()
    engine.observe_logits = recorder.observe
    for request in requests:
        engine.submit(request, recorder.outputs.append)
    steps = drain(engine)
    check_sequence_cache(engine.cache)
    pool = engine.cache.pool
    assert pool.num_private == 0 and pool.num_free + pool.num_cached == pool.usable_pages
    return recorder, steps


def _request(request_id: str = "r", prediction: str = "", **sampling: Any) -> GenerateRequest:
    params = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True} | sampling
    return GenerateRequest(
        request_id, prompt=PROMPT, sampling=SamplingParams(**params, prediction=prediction)
    )


def _usage(recorder: Recorder, request_id: str, index: int = 0) -> tuple[int, int]:
    mine = [o for o in recorder.outputs if o.request_id == request_id and o.index == index]
    accepted = sum(o.accepted_prediction_tokens for o in mine)
    return accepted, sum(o.rejected_prediction_tokens for o in mine)


def test_a_prediction_of_the_whole_answer_is_accepted_whole_in_fewer_steps(
    tiny: LoadedModel,
) -> None:
    words = _words(tiny)
    assert len(words) >= 8
    sampling: dict[str, Any] = {"allowed_token_ids": words, "max_tokens": 60}
    plain, plain_steps = _run(_engine(tiny), _request(**sampling))
    answer = plain.tokens("r")
    assert len(answer) == 60
    assert tiny.tokenizer is not None
    text = tiny.tokenizer.decode(answer)
    engine = _engine(tiny)
    predicted, steps = _run(engine, _request(prediction=text, **sampling))
    assert predicted.tokens("r") == answer
    # every token was the prediction's at its place, and no draft token was computed in vain
    assert _usage(predicted, "r") == (60, 0)
    # one step the prompt and first token, then 16 drafted tokens and the one after them a
    # step (the last step 7 and one: what max_tokens leaves)
    assert plain_steps == 60 and steps == 1 + 4
    stats = engine.stats()
    assert stats.prediction_draft_tokens == stats.accepted_prediction_draft_tokens == 3 * 16 + 7
    assert stats.generated_tokens == 60
    for key, logits in predicted.logits.items():
        torch.testing.assert_close(logits, plain.logits[key], rtol=1e-4, atol=1e-4)


def _edited(tiny: LoadedModel, tokens: Sequence[int]) -> str:
    """The text of `tokens` with a phrase put in its middle and a word left out after it."""
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    half = len(tokens) // 2
    return (
        tokenizer.decode(tokens[:half])
        + " banana split"
        + tokenizer.decode(tokens[half : half + 5])
        + tokenizer.decode(tokens[half + 6 :])
    )


SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "seeded": {"temperature": 0.8, "seed": 3},
    "n=2 with logprobs": {"temperature": 0.8, "seed": 5, "n": 2, "logprobs": 2},
    "penalties": {"frequency_penalty": 0.3, "repetition_penalty": 1.1},
    "stop string": {"max_tokens": 60},
}


@pytest.mark.parametrize("name", SAMPLINGS)
@pytest.mark.parametrize("speculating", [0, 4])
def test_a_prediction_changes_the_steps_not_the_tokens(
    tiny: LoadedModel, name: str, speculating: int
) -> None:
    sampling: dict[str, Any] = {"allowed_token_ids": _words(tiny)} | SAMPLINGS[name]
    plain, _ = _run(_engine(tiny), _request(**sampling))
    assert tiny.tokenizer is not None
    answer = plain.tokens("r")
    edited = _edited(tiny, answer)
    if name == "stop string":  # a word of the answer ends it: the prediction runs past the end
        at = next(i for i in range(40, 60) if answer[i] not in answer[:i])
        stop = tiny.tokenizer.decode(answer[at : at + 1])
        sampling["stop"] = (stop,)
        plain, _ = _run(_engine(tiny), _request(**sampling))
        assert plain.final("r").stop_string == stop and len(plain.tokens("r")) == at + 1
    engine = _engine(tiny, num_speculative_tokens=speculating)
    predicted, _ = _run(engine, _request(prediction=edited, **sampling))
    streams = {(o.request_id, o.index) for o in plain.outputs}
    for request_id, index in streams:
        assert predicted.tokens(request_id, index) == plain.tokens(request_id, index)
        final, expected = predicted.final(request_id, index), plain.final(request_id, index)
        assert (final.finish_reason, final.stop_string) == (
            expected.finish_reason,
            expected.stop_string,
        )
        text = "".join(o.text for o in predicted.outputs if o.index == index)
        assert text == "".join(o.text for o in plain.outputs if o.index == index)
    ordered = sorted(predicted.outputs, key=lambda o: o.index)  # stable
    expected_ordered = sorted(plain.outputs, key=lambda o: o.index)
    tops = [lp.top for o in ordered for lp in o.logprobs]
    expected_tops = [lp.top for o in expected_ordered for lp in o.logprobs]
    assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in expected_tops]
    values = [v for top in tops for _, v in top]
    assert values == pytest.approx([v for top in expected_tops for _, v in top], abs=1e-3)
    stats = engine.stats()
    rejected = sum(_usage(predicted, "r", i)[1] for i in range(sampling.get("n", 1)))
    assert rejected == stats.prediction_draft_tokens - stats.accepted_prediction_draft_tokens
    # sample 0 writes the answer the prediction was made from, but for the edit
    accepted, _ = _usage(predicted, "r")
    assert stats.accepted_prediction_draft_tokens > 15 and accepted > 25, (accepted, stats)


def test_a_prediction_nothing_like_the_answer_drafts_nothing(tiny: LoadedModel) -> None:
    engine = _engine(tiny)
    plain, steps = _run(_engine(tiny), _request())
    recorder, predicted_steps = _run(engine, _request(prediction="zzzz qqqq xxxx"))
    assert recorder.tokens("r") == plain.tokens("r") and predicted_steps == steps
    assert _usage(recorder, "r") == (0, 0) and engine.stats().prediction_draft_tokens == 0


def test_num_prediction_tokens_0_ignores_predictions(tiny: LoadedModel) -> None:
    sampling: dict[str, Any] = {"allowed_token_ids": _words(tiny)}
    plain, steps = _run(_engine(tiny), _request(**sampling))
    assert tiny.tokenizer is not None
    text = tiny.tokenizer.decode(plain.tokens("r"))
    engine = _engine(tiny, num_prediction_tokens=0)
    recorder, predicted_steps = _run(engine, _request(prediction=text, **sampling))
    assert recorder.tokens("r") == plain.tokens("r") and predicted_steps == steps
    assert _usage(recorder, "r") == (0, 0) and engine.stats().prediction_draft_tokens == 0


def test_a_bad_prediction_is_refused_naming_it(tiny: LoadedModel) -> None:
    engine = _engine(tiny, max_model_len=64)
    with pytest.raises(InvalidRequest, match="tokens; a sequence holds at most 64") as long:
        engine.submit(_request(prediction=" the" * 100), lambda _: None)
    assert long.value.field == "prediction"
    too_many = SamplingParams(prediction="x" * (MAX_PREDICTION_CHARS + 1))
    with pytest.raises(InvalidRequest, match="characters; at most") as chars:
        too_many.validate(512, 100)
    assert chars.value.field == "prediction"
    with pytest.raises(InvalidRequest, match="no tokenizer") as none:
        predicted_output("some text", None, 100, 2, 8)
    assert none.value.field == "prediction"
    # the engine still serves, every page back
    recorder, _ = _run(engine, _request(max_tokens=8))
    assert len(recorder.tokens("r")) == 8
