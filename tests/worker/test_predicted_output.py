"""Predicted outputs (OpenAI's `prediction`, worker/predicted_output.py): a prediction changes
how many steps a sample takes, never what it generates, and the usage says what the prediction
was worth: the cursor and the draft check on token lists, then the tiny model's engine with and
without a prediction, token for token."""

from __future__ import annotations

import dataclasses
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
from worker.request import FINISH_LENGTH, GenerateRequest, Resume
from worker.sampling_params import MAX_PREDICTION_CHARS, SamplingParams
from worker.tiny_model import TINY_CONFIG, tiny_model

PROMPT = "the quick brown"


# -- the cursor ---------------------------------------------------------------------------------


def _cursor(prediction: Sequence[int], written: Sequence[int] = ()) -> PredictionCursor:
    return PredictionCursor(PredictedOutput(prediction, 2, 8), written)


def test_a_cursor_that_follows_proposes_what_comes_next() -> None:
    cursor = _cursor([10, 11, 12, 13, 14, 15])
    assert cursor.propose(4) == [10, 11, 12, 13]
    assert cursor.follow(10) and cursor.follow(11)
    assert cursor.propose(10) == [12, 13, 14, 15]
    assert all(cursor.follow(token) for token in (12, 13, 14, 15))
    assert cursor.propose(4) == []  # used up
    assert not cursor.follow(16)


def test_a_lost_cursor_realigns_where_the_output_rejoins_the_prediction() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    cursor = _cursor(prediction)
    written = [10, 11, 99, 98, 13, 14]  # an edit, then the prediction again from 13
    assert [cursor.follow(token) for token in written] == [True, True, False, False, False, False]
    assert cursor.propose(3) == [15, 16, 17]  # found again at (13, 14)
    assert cursor.follow(15) and cursor.follow(16)
    # its last tokens nowhere in the prediction: lost, until they are
    assert not cursor.follow(77) and cursor.propose(3) == []
    assert not cursor.follow(17) and cursor.propose(3) == []  # (77, 17) occurs nowhere
    assert not cursor.follow(18) and cursor.propose(3) == []  # 18 ends it: nothing after
    assert not cursor.follow(12) and not cursor.follow(13)
    assert cursor.propose(2) == [14, 15]


def test_realigning_prefers_the_longest_match_then_the_nearest_place() -> None:
    # followed to 2, then 6 where the prediction has 9: (5, 6) ends at 6 and at 10, and only
    # the occurrence ending at 10 has the 4 before it that the output has
    prediction = [4, 5, 9, 0, 5, 6, 1, 4, 5, 6, 2]
    cursor = _cursor(prediction)
    assert [cursor.follow(t) for t in (4, 5, 6)] == [True, True, False]
    assert cursor.propose(1) == [2]
    # equally long matches: the first at or after where the cursor last was (position 3) ...
    prediction = [5, 6, 1, 5, 6, 2, 4, 5, 6, 3]
    cursor = _cursor(prediction, written=[5, 6, 1])
    assert [cursor.follow(t) for t in (8, 5, 6)] == [False, False, False]
    assert cursor.propose(1) == [2]
    # ... and with none after it, the nearest before it
    prediction = [5, 6, 1, 5, 6, 2, 7, 7, 7]
    cursor = _cursor(prediction, written=prediction)
    assert [cursor.follow(t) for t in (8, 5, 6)] == [False, False, False]
    assert cursor.propose(1) == [2]


def test_a_resumed_sample_follows_what_it_wrote_before() -> None:
    cursor = _cursor([10, 11, 12, 13], written=[10, 11])
    assert cursor.propose(5) == [12, 13]
    lost = _cursor([10, 11, 12, 13, 14], written=[10, 99, 12, 13])  # realigned on (12, 13)
    assert lost.propose(5) == [14]


@settings(max_examples=300, deadline=None)
@given(
    prediction=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    output=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    cut=st.integers(0, 40),
)
def test_a_cursor_follows_the_tokens_whatever_cuts_them(
    prediction: list[int], output: list[int], cut: int
) -> None:
    """Token by token, a cursor is in place exactly where the prediction has the output's
    token at its place, proposes the run of the prediction after a place that the output's
    last token ends (its last two, when it realigned), and a cursor made with what a sample
    wrote before (a resumed one) is the one that followed it."""
    cursor = _cursor(prediction)
    for i, token in enumerate(output):
        was = cursor.at
        in_place = was is not None and prediction[was : was + 1] == [token]
        assert cursor.follow(token) == in_place
        at, draft = cursor.at, cursor.propose(4)
        if at is None:
            assert draft == []
            continue
        assert draft == prediction[at : at + 4] and prediction[at - 1] == token
        if not in_place:
            assert prediction[at - 2 : at] == output[i - 1 : i + 1]
    resumed = _cursor(prediction, written=output[:cut])
    replayed = _cursor(prediction)
    for token in output[:cut]:
        replayed.follow(token)
    assert (resumed.at, resumed.last, resumed.recent) == (
        replayed.at,
        replayed.last,
        replayed.recent,
    )


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


def test_a_bad_prediction_is_refused_naming_it_and_a_long_one_is_cut(tiny: LoadedModel) -> None:
    too_many = SamplingParams(prediction="x" * (MAX_PREDICTION_CHARS + 1))
    with pytest.raises(InvalidRequest, match="characters; at most") as chars:
        too_many.validate(512, 100)
    assert chars.value.field == "prediction"
    with pytest.raises(InvalidRequest, match="no tokenizer") as none:
        predicted_output("some text", None, 512, 100, 2, 8)
    assert none.value.field == "prediction"
    long = predicted_output(" the" * 100, tiny.tokenizer, 512, 64, 2, 8)
    assert long is not None and len(long.tokens) == 64
    # an engine whose context a prediction outgrows serves the request with it, every page back
    recorder, _ = _run(
        _engine(tiny, max_model_len=64), _request(max_tokens=8, prediction=" the" * 100)
    )
    assert len(recorder.tokens("r")) == 8


def _whole_answer(tiny: LoadedModel, **sampling: Any) -> tuple[list[int], str]:
    """A greedy answer of 60 word tokens, and its text (which tokenizes back to it)."""
    plain, _ = _run(_engine(tiny), _request(allowed_token_ids=_words(tiny), max_tokens=60))
    answer = plain.tokens("r")
    assert tiny.tokenizer is not None
    return answer, tiny.tokenizer.decode(answer)


def test_a_sample_that_stops_inside_a_draft_rejects_the_rest_of_it(tiny: LoadedModel) -> None:
    answer, text = _whole_answer(tiny)
    # a stop token inside the second draft (positions 18-33: the first token comes with the
    # prompt, then 16 drafted and one more a step), its first occurrence in the answer
    stop = next(i for i in range(20, 33) if answer[i] not in answer[:i])
    sampling = {"allowed_token_ids": _words(tiny), "max_tokens": 60}
    recorder, steps = _run(
        _engine(tiny),
        _request(prediction=text, stop_token_ids=(answer[stop],), ignore_eos=False, **sampling),
    )
    assert recorder.tokens("r") == answer[: stop + 1] and steps == 3
    # every token was the prediction's; of the second draft's 16, those after the stop
    assert _usage(recorder, "r") == (stop + 1, 16 - (stop - 18) - 1)


def test_a_resumed_sample_counts_what_the_uninterrupted_one_does(tiny: LoadedModel) -> None:
    assert tiny.tokenizer is not None
    prompt = tuple(tiny.tokenizer.encode(PROMPT))
    words = _words(tiny)
    sampling = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, allowed_token_ids=words
    )
    plain, _ = _run(_engine(tiny), GenerateRequest("r", prompt, sampling=sampling))
    answer = plain.tokens("r")
    predicted = dataclasses.replace(sampling, prediction=_edited(tiny, answer))
    whole, _ = _run(_engine(tiny), GenerateRequest("r", prompt, sampling=predicted))
    assert whole.tokens("r") == answer
    each = [o.accepted_prediction_tokens for o in whole.outputs if o.token_ids]
    assert len(each) == 40 and 0 < sum(each) < 40
    for cut in (5, 19, 23, 30):
        resumed = GenerateRequest(
            "r", (*prompt, *answer[:cut]), sampling=predicted, resume=Resume(0, cut)
        )
        rest, _ = _run(_engine(tiny), resumed)
        assert rest.tokens("r") == answer[cut:]
        assert _usage(rest, "r")[0] == sum(each[cut:]), cut


def test_prediction_tokens_past_the_models_vocabulary_are_cut_and_fail_no_one(
    tiny: LoadedModel,
) -> None:
    """A tokenizer may spell ids its model does not have (its vocabulary past the model's).
    A prediction is a hint, never a reason to fail (vLLM and OpenAI never fail a request for
    it), so it is cut at its first such id and only the tokens before it are drafted; an id
    the embedding cannot look up once failed every request of its step. The request and one
    beside it are served to their length, every page and id back."""
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    model = tiny_model(dataclasses.replace(TINY_CONFIG, vocab_size=384), seed=1)
    words = _words(tiny)
    inside, outside = next(t for t in words if t < 384), next(t for t in words if t >= 384)
    cut = predicted_output(tokenizer.decode([inside, outside, inside]), tokenizer, 384, 64, 2, 8)
    assert cut is not None and list(cut.tokens) == [inside]
    engine = Engine(model, tokenizer, EngineConfig(num_pages=64, page_size=4, max_model_len=64))
    prediction = tokenizer.decode([inside] * 3 + [outside] * 3)
    predicted = SamplingParams(
        max_tokens=10, temperature=0, allowed_token_ids=(inside,), prediction=prediction
    )
    plain = SamplingParams(max_tokens=10, temperature=0)
    recorder, _ = _run(
        engine,
        GenerateRequest("p", (5, 6, 7), sampling=predicted),
        GenerateRequest("bystander", (8, 9, 10), sampling=plain),
    )
    for request_id in ("p", "bystander"):
        final = recorder.final(request_id)
        assert (final.finish_reason, final.error) == (FINISH_LENGTH, None), request_id
        assert len(recorder.tokens(request_id)) == 10
    assert recorder.tokens("p") == [inside] * 10
    # drafted from the three tokens before the cut alone (at the start, then realigned on
    # them), each draft drawn: an id past the cut would have been rejected, if not failed
    assert _usage(recorder, "p") == (6, 0) and engine.stats().prediction_draft_tokens == 5
    assert not engine.active_requests
