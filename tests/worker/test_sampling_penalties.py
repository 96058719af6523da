"""Presence, frequency and repetition penalties: the sampler's arithmetic on hand-made logits, a
from-scratch reference over random histories, and the engine applying them at every step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.worker.helpers import LLAMA, drain, greedy, recorded_engine
from worker.engine import EngineConfig
from worker.penalties import Penalties
from worker.sampling import Sampler
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

MODEL = tiny_model(LLAMA, seed=5)
PROMPT = [1, 17, 30, 99, 250, 17, 4]


def reference(
    logits: Sequence[float], prompt: Sequence[int], generated: Sequence[int], p: SamplingParams
) -> torch.Tensor:
    """The penalized logits computed from scratch: a plain loop over the whole history."""
    scores = list(logits)
    for token in range(len(scores)):
        if token in prompt or token in generated:
            r = p.repetition_penalty
            scores[token] = scores[token] / r if scores[token] > 0 else scores[token] * r
        times = sum(1 for t in generated if t == token)
        scores[token] -= p.frequency_penalty * times
        if times:
            scores[token] -= p.presence_penalty
    return torch.tensor(scores, dtype=torch.float32)


def greedy_draws(params: SamplingParams, logits: torch.Tensor, count: int) -> list[int]:
    penalties = Penalties.create(params, [], logits.shape[0])
    sampler = Sampler.create(params, 0, penalties)
    return [sampler(logits, position) for position in range(count)]


def test_frequency_penalizes_each_occurrence_and_presence_only_the_first() -> None:
    logits = torch.tensor([3.0, 2.0, -5.0])
    assert greedy_draws(SamplingParams(temperature=0.0), logits, 5) == [0, 0, 0, 0, 0]
    # 0 once: 1 < 2, so 1; both once: 1 > 0, so 0; 0 twice: -1 < 0, so 1; ...
    frequency = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert greedy_draws(frequency, logits, 5) == [0, 1, 0, 1, 0]
    # presence costs both 2 once: 1 > 0 from then on
    presence = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert greedy_draws(presence, logits, 5) == [0, 1, 0, 0, 0]


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0, 0.5, 0.0])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    penalties = Penalties.create(params, [0, 1, 0, 5], 6)
    assert penalties is not None
    assert penalties.apply(logits).tolist() == [1.0, -4.0, 2.0, -2.0, 0.5, 0.0]
    penalties.record(4)  # generated tokens count as seen too
    assert penalties.apply(logits).tolist() == [1.0, -4.0, 2.0, -2.0, 0.25, 0.0]
    assert logits.tolist() == [2.0, -2.0, 2.0, -2.0, 0.5, 0.0], "the row must stay untouched"
    sampler = Sampler.create(params, 0, Penalties.create(params, [0], 2))
    assert sampler(torch.tensor([2.0, 1.5]), 0) == 1  # 2 / 2 < 1.5


def test_penalties_that_change_nothing_draw_exactly_the_unpenalized_tokens() -> None:
    none = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    assert Penalties.create(none, PROMPT, 512) is None, "no state for an unpenalized request"
    # a zero-valued state still on the path: same logits, same generator, same draws
    params = SamplingParams(temperature=1.0, seed=7)
    zero = Penalties(0.0, 0.0, 1.0, torch.zeros(6), torch.zeros(6), torch.ones(6))
    plain, penalized = Sampler.create(params, 0), Sampler.create(params, 0, zero)
    logits = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.2, 0.0])
    draws = [plain(logits, p) for p in range(200)]
    assert [penalized(logits, p) for p in range(200)] == draws
    assert len(set(draws)) == 6


@given(
    logits=st.lists(st.floats(-10, 10, width=32), min_size=2, max_size=12),
    data=st.data(),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
)
def test_penalized_logits_equal_a_reference_over_the_whole_history(
    logits: list[float],
    data: st.DataObject,
    presence: float,
    frequency: float,
    repetition: float,
) -> None:
    vocab = len(logits)
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20))
    generated = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30))
    params = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition
    )
    expected = reference(logits, prompt, generated, params)
    row = torch.tensor(logits, dtype=torch.float32)
    incremental = Penalties.create(params, prompt, vocab)
    resumed = Penalties.create(params, [*prompt, *generated], vocab)
    if incremental is None or resumed is None:
        assert not params.penalized
        return
    for token in generated:
        incremental.record(token)
    resumed.replay(generated)  # a resumed sample: its prompt ends with what it generated
    torch.testing.assert_close(incremental.apply(row), expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(resumed.apply(row), incremental.apply(row), rtol=0, atol=0)


@given(seed=st.integers(0, 2**32), history=st.lists(st.integers(0, 7), max_size=12))
def test_a_sampler_that_replays_the_history_draws_what_the_first_would(
    seed: int, history: list[int]
) -> None:
    """The draw at a position is a function of the seed, the position and the history only."""
    params = SamplingParams(
        temperature=1.0,
        seed=seed,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
    )
    logits = torch.linspace(1.0, -1.0, 8)
    penalties = Penalties.create(params, [1, 3, 3], 8)
    assert penalties is not None
    for token in history:
        penalties.record(token)
    first = Sampler.create(params, 2, penalties)
    drawn = [first(logits, len(history) + k) for k in range(4)]
    later = Sampler.create(params, 2, Penalties.create(params, [1, 3, 3, *history], 8))
    later.replay(history)
    assert [later(logits, len(history) + k) for k in range(4)] == drawn


def greedy_run(**penalties: float) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of PROMPT on the tiny model, and the raw logits each was drawn from."""
    engine, recorder = recorded_engine(MODEL, EngineConfig(num_pages=64, page_size=4))
    request = greedy("run", PROMPT, 40, ignore_eos=True, **penalties)
    engine.submit(request, recorder.outputs.append)
    drain(engine)
    tokens = recorder.tokens("run")
    return tokens, [recorder.logits[("run", 0, len(PROMPT) + i)] for i in range(len(tokens))]


def test_a_large_presence_penalty_keeps_greedy_decoding_from_repeating() -> None:
    plain, _ = greedy_run()
    assert len(set(plain)) < len(plain) == 40, "the unpenalized run should repeat itself"
    penalized, _ = greedy_run(presence_penalty=2.0)
    assert len(set(penalized)) == len(penalized) == 40


def test_each_greedy_token_is_the_argmax_of_the_logits_penalized_for_its_history() -> None:
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4)
    tokens, logits = greedy_run(**penalties)
    assert tokens != greedy_run()[0], "the penalties should change the answer"
    params = SamplingParams(**penalties)  # type: ignore[arg-type]
    for i, (token, row) in enumerate(zip(tokens, logits, strict=True)):
        expected = reference(row.tolist(), PROMPT, tokens[:i], params)
        assert token == int(torch.argmax(expected)), f"token {i}"
