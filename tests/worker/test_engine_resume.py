"""A sample resumed from the tokens its client already has finishes exactly as if never cut.

What the router does when a worker dies mid-stream (cluster/stream_progress.py), here on one
engine: run a request whole, then for cuts along its stream submit the prompt plus the first k
generated tokens with `Resume(sample, k)`. What the client would see, the first k messages of
the whole run followed by the resumed stream, must equal the whole run: tokens, text (stop
strings held back across the cut included), finish reason, and the draws of seeded sampling
(penalized by the tokens generated before the cut too), with the same logprobs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.worker.helpers import run_to_end
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel
from worker.request import FINISH_LENGTH, FINISH_STOP, GenerateRequest, RequestOutput, Resume
from worker.sampling_params import SamplingParams

PROMPT = "The router moves a stream to another worker"
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)


def engine_for(loaded: LoadedModel) -> Engine:
    config = EngineConfig(num_pages=256, page_size=4, model_revision=loaded.revision)
    return Engine(loaded.model, loaded.tokenizer, config)


def of_sample(outputs: list[RequestOutput], index: int) -> list[RequestOutput]:
    return [o for o in outputs if o.index == index]


def seen(outputs: list[RequestOutput]) -> tuple[list[int], str, str | None]:
    """What a client has from these messages: tokens, text, finish reason."""
    tokens = [t for o in outputs for t in o.token_ids]
    return tokens, "".join(o.text for o in outputs), outputs[-1].finish_reason


def resumed(
    loaded: LoadedModel,
    whole: list[RequestOutput],
    cut: int,
    sampling: SamplingParams,
    index: int = 0,
) -> list[RequestOutput]:
    """The client's view when sample `index` of `whole` is cut after `cut` messages and
    resumed on a fresh engine (nothing cached: a worker that never saw the request)."""
    assert loaded.tokenizer is not None
    prompt = loaded.tokenizer.encode(PROMPT)
    before = of_sample(whole, index)[:cut]
    tokens = [t for o in before for t in o.token_ids]
    request = GenerateRequest(
        "resumed",
        prompt_token_ids=(*prompt, *tokens),
        sampling=sampling,
        resume=Resume(index, len(tokens)),
    )
    after = run_to_end(engine_for(loaded), request)
    assert {o.index for o in after} == {index}
    assert all(o.prompt_tokens == len(prompt) for o in after)
    return before + after


def assert_same_logprobs(got: list[RequestOutput], expected: list[RequestOutput]) -> None:
    """Equal up to the float noise of computing a position in a prefill rather than a decode."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert len(a.logprobs) == len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            values = [x.logprob, *(v for _, v in x.top)]
            assert values == pytest.approx([y.logprob, *(v for _, v in y.top)], abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_resumed_sample_continues_exactly(tiny: LoadedModel, temperature: float) -> None:
    sampling = SamplingParams(max_tokens=24, temperature=temperature, seed=11, ignore_eos=True)
    whole = run_to_end(engine_for(tiny), GenerateRequest("whole", prompt=PROMPT, sampling=sampling))
    expected = seen(whole)
    assert len(expected[0]) == 24 and expected[2] == FINISH_LENGTH
    for cut in (1, 2, 7, 16, 23):
        assert seen(resumed(tiny, whole, cut, sampling)) == expected, f"cut after {cut}"


def test_a_penalized_sample_resumes_with_its_counts_and_its_logprobs(tiny: LoadedModel) -> None:
    """The resumed worker counts the generated tokens of its prompt for presence and frequency
    (and the whole prompt for repetition), so the draws after the cut are penalized alike."""
    sampling = SamplingParams(
        max_tokens=24, temperature=1.0, seed=11, ignore_eos=True, logprobs=3, **PENALTIES
    )
    whole = run_to_end(engine_for(tiny), GenerateRequest("whole", prompt=PROMPT, sampling=sampling))
    plain = replace(sampling, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    unpenalized = run_to_end(
        engine_for(tiny), GenerateRequest("plain", prompt=PROMPT, sampling=plain)
    )
    assert seen(whole)[0] != seen(unpenalized)[0], "the penalties should change the draws"
    for cut in (1, 7, 16, 23):
        got = resumed(tiny, whole, cut, sampling)
        assert seen(got) == seen(whole), f"cut after {cut}"
        assert_same_logprobs(got, whole)


@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalized"])
def test_a_resumed_sample_of_several_draws_as_that_sample(
    tiny: LoadedModel, penalties: dict[str, float]
) -> None:
    """Each of n samples draws as that sample alone would: penalized by its own tokens only."""
    sampling = SamplingParams(
        max_tokens=20, temperature=1.0, seed=5, n=3, ignore_eos=True, **penalties
    )
    whole = run_to_end(engine_for(tiny), GenerateRequest("whole", prompt=PROMPT, sampling=sampling))
    streams = [seen(of_sample(whole, i)) for i in range(3)]
    assert len({tuple(tokens) for tokens, _, _ in streams}) == 3, "samples should differ"
    alone = replace(sampling, n=1)
    for index in (1, 2):
        for cut in (0, 9):
            got = seen(resumed(tiny, whole, cut, alone, index))
            assert got == streams[index], f"sample {index} cut after {cut}"


def test_a_stop_string_across_the_cut_is_still_found(tiny: LoadedModel) -> None:
    """Cut while the first characters of the stop string are held back: the resumed worker
    holds them too and stops where the whole run stopped, never sending them."""
    assert tiny.tokenizer is not None
    free = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    text = seen(
        run_to_end(engine_for(tiny), GenerateRequest("free", prompt=PROMPT, sampling=free))
    )[1]
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    assert len(stop.strip()) > 2, f"pick a visible stop string from {text!r}"
    sampling = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=(stop,))
    whole = run_to_end(engine_for(tiny), GenerateRequest("whole", prompt=PROMPT, sampling=sampling))
    expected = seen(whole)
    assert expected[1] == text[: text.index(stop)] and expected[2] == FINISH_STOP
    held = [k for k, o in enumerate(whole, 1) if o.token_ids and not o.text and not o.finished]
    assert held, "some message should have held text back"
    for cut in {*held, len(whole) - 1}:
        assert seen(resumed(tiny, whole, cut, sampling)) == expected, f"cut after {cut}"


def test_a_resumed_sample_whose_stop_string_is_complete_ends_at_once(tiny: LoadedModel) -> None:
    """The router resumes only unfinished samples; a worker given a finished one sends nothing
    more than the end, instead of generating past its stop string."""
    assert tiny.tokenizer is not None
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    free_run = run_to_end(engine_for(tiny), GenerateRequest("free", prompt=PROMPT, sampling=free))
    tokens, text, _ = seen(free_run)
    stop = text[-4:]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    stopping = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    prompt = tiny.tokenizer.encode(PROMPT)
    request = GenerateRequest(
        "done",
        prompt_token_ids=(*prompt, *tokens),
        sampling=stopping,
        resume=Resume(0, len(tokens)),
    )
    (only,) = run_to_end(engine_for(tiny), request)
    assert (only.token_ids, only.text, only.finish_reason) == ((), "", FINISH_STOP)


def test_a_stop_string_min_tokens_passed_over_before_the_cut_stays_passed_over(
    tiny: LoadedModel,
) -> None:
    """A stop string that occurred within min_tokens did not end the sample; the resumed worker
    replays those tokens unarmed too, so it neither ends at once nor cuts the text there, and
    the stop string's next occurrence ends it where it ended the whole run (and stays in the
    text, with include_stop_str_in_output)."""
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    text = seen(
        run_to_end(engine_for(tiny), GenerateRequest("free", prompt=PROMPT, sampling=free))
    )[1]
    stop = next(c for c in text[:3] if c.isascii() and text.rfind(c) >= 16)
    sampling = replace(free, stop=(stop,), min_tokens=8, include_stop_str_in_output=True)
    whole = run_to_end(engine_for(tiny), GenerateRequest("whole", prompt=PROMPT, sampling=sampling))
    expected = seen(whole)
    assert expected[2] == FINISH_STOP and len(expected[0]) > 8
    assert expected[1].endswith(stop) and len(expected[1]) > text.index(stop) + 1
    for cut in (2, 5, 8, len(whole) - 1):
        assert seen(resumed(tiny, whole, cut, sampling)) == expected, f"cut after {cut}"


def test_a_resumed_sample_reports_cache_hits_of_its_prompt_only(tiny: LoadedModel) -> None:
    """On the worker that already holds the whole stream, far more than the prompt hits the
    cache; what a client is told it saved is still counted in its own prompt's tokens."""
    assert tiny.tokenizer is not None
    prompt = tiny.tokenizer.encode(PROMPT)
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = engine_for(tiny)
    whole = run_to_end(
        engine, GenerateRequest("whole", prompt_token_ids=tuple(prompt), sampling=sampling)
    )
    tokens = seen(whole)[0][:16]
    request = GenerateRequest(
        "again", (*prompt, *tokens), sampling=sampling, resume=Resume(0, len(tokens))
    )
    after = run_to_end(engine, request)
    assert all(o.prompt_tokens == len(prompt) for o in after)
    assert {o.cached_prompt_tokens for o in after} == {len(prompt)}  # all of it, no more
    assert engine.stats().cached_prompt_tokens <= 2 * len(prompt)
