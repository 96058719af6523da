"""vLLM's sampling parameters beyond OpenAI's (min_p, min_tokens, allowed_token_ids) and OpenAI's
logit_bias: the sampler on hand-made logits against a from-scratch reference, stop strings held
off by min_tokens, the parameters across the wire and refused by name, and the engine drawing
with them on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from protos.radixmesh.v1 import serving_pb2
from tests.worker.helpers import LLAMA, drain, greedy, recorded_engine
from worker.engine import EngineConfig
from worker.errors import InvalidRequest
from worker.logit_shaping import LogitShaping
from worker.penalties import Penalties
from worker.sampling import Sampler
from worker.sampling_params import SamplingParams
from worker.stop import StopChecker
from worker.tiny_model import tiny_model
from worker.wire import sampling_from_proto, sampling_to_proto

MODEL = tiny_model(LLAMA, seed=5)
PROMPT = [1, 17, 30, 99, 250, 17, 4]
EOS = 2
"""The tiny model's end-of-sequence id."""


def sampler(params: SamplingParams, vocab: int, prompt: list[int] | None = None) -> Sampler:
    """A sample's sampler as the engine builds it (shaping, then penalties)."""
    return Sampler.create(
        params,
        0,
        Penalties.create(params, prompt or [], vocab),
        shaping=LogitShaping.create(params, [EOS], vocab),
    )


def reference(
    logits: list[float], params: SamplingParams, generated: int, end_ids: set[int]
) -> list[float]:
    """The shaped logits from scratch: a loop over the vocabulary."""
    bias = dict(params.logit_bias)
    allowed = set(params.allowed_token_ids) or set(range(len(logits)))
    held = set(params.stop_token_ids) | (set() if params.ignore_eos else end_ids)
    out = []
    for token, logit in enumerate(logits):
        if token not in allowed or (generated < params.min_tokens and token in held):
            out.append(-math.inf)
        else:
            out.append(logit + bias.get(token, 0.0))
    return out


@given(
    logits=st.lists(st.floats(-10, 10, width=32), min_size=4, max_size=12),
    data=st.data(),
    min_tokens=st.integers(0, 4),
    ignore_eos=st.booleans(),
)
def test_shaped_logits_equal_a_reference_at_every_step(
    logits: list[float], data: st.DataObject, min_tokens: int, ignore_eos: bool
) -> None:
    vocab = len(logits)
    ids = st.integers(0, vocab - 1)
    biased = data.draw(st.dictionaries(ids, st.floats(-100, 100, width=32), max_size=4))
    allowed = data.draw(st.lists(ids, max_size=5, unique=True))
    stop_ids = data.draw(st.lists(ids, max_size=2, unique=True))
    params = SamplingParams(
        max_tokens=8,
        min_tokens=min_tokens,
        logit_bias=tuple(sorted(biased.items())),
        allowed_token_ids=tuple(allowed),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
    )
    row = torch.tensor(logits, dtype=torch.float32)
    shaping = LogitShaping.create(params, [EOS], vocab)
    for generated in range(6):
        expected = reference(logits, params, generated, {EOS})
        if shaping is None:
            assert expected == logits
            continue
        torch.testing.assert_close(
            shaping.apply(row, generated), torch.tensor(expected), rtol=0, atol=1e-5
        )
    assert row.tolist() == logits, "the raw row must stay untouched"


def test_logit_bias_moves_the_greedy_choice_and_allowed_tokens_confine_every_draw() -> None:
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0, 0.5, -1.0])
    base = SamplingParams(temperature=0.0, max_tokens=4)
    assert sampler(base, 6)(logits, 0) == 1
    banned = SamplingParams(temperature=0.0, max_tokens=4, logit_bias=((1, -100.0),))
    assert sampler(banned, 6)(logits, 0) == 2
    forced = SamplingParams(temperature=0.0, max_tokens=4, logit_bias=((5, 100.0),))
    assert sampler(forced, 6)(logits, 0) == 5
    allowed = SamplingParams(temperature=1.0, seed=3, max_tokens=4, allowed_token_ids=(0, 4, 5))
    draws = {sampler(allowed, 6)(logits, p) for p in range(300)}
    assert draws == {0, 4, 5}, "every allowed token drawn, and nothing else"
    greedy_allowed = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=(0, 4, 5))
    assert sampler(greedy_allowed, 6)(logits, 0) == 4


def test_min_tokens_holds_back_end_of_sequence_and_stop_ids_then_lets_them_go() -> None:
    logits = torch.tensor([0.0, 1.0, 5.0, 4.0, 3.0])  # EOS (2) is the most likely, then 3
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, stop_token_ids=(3,))
    draw = sampler(params, 5)
    assert [draw(logits, p) for p in range(5)] == [4, 4, 4, 2, 2]
    ignoring = SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=(3,), ignore_eos=True
    )
    draw = sampler(ignoring, 5)  # with ignore_eos, EOS ends nothing: it is not held back
    assert [draw(logits, p) for p in range(3)] == [2, 2, 2]


@given(seed=st.integers(0, 2**32), steps=st.integers(0, 7))
def test_a_resumed_sampler_holds_back_exactly_what_the_first_would(seed: int, steps: int) -> None:
    """A sample moved to another worker after `steps` tokens replays them; its min_tokens
    count goes on from there."""
    params = SamplingParams(
        temperature=1.0, seed=seed, max_tokens=16, min_tokens=5, logit_bias=((EOS, 3.0),)
    )
    logits = torch.linspace(1.0, -1.0, 6)
    first = sampler(params, 6)
    history = [first(logits, p) for p in range(steps)]
    drawn = [first(logits, steps + k) for k in range(6)]
    assert EOS not in (history + drawn)[:5]
    later = sampler(params, 6)
    later.replay(history)
    assert [later(logits, steps + k) for k in range(6)] == drawn


@given(
    logits=st.lists(st.floats(-6, 6, width=32), min_size=2, max_size=10),
    min_p=st.floats(0.01, 1.0),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**32),
)
def test_min_p_draws_only_tokens_at_least_min_p_times_as_likely_as_the_best(
    logits: list[float], min_p: float, temperature: float, seed: int
) -> None:
    params = SamplingParams(temperature=temperature, seed=seed, min_p=min_p, max_tokens=4)
    probs = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, dim=-1)
    draw = Sampler.create(params, 0)
    for position in range(8):
        token = draw(torch.tensor(logits, dtype=torch.float32), position)
        assert probs[token] >= min_p * probs.max() * (1 - 1e-6)


def test_min_p_of_one_is_greedy_and_zero_changes_nothing() -> None:
    logits = torch.tensor([0.3, 2.0, 1.9, -1.0])
    assert {Sampler.create(SamplingParams(seed=1, min_p=1.0), 0)(logits, p) for p in range(50)} == {
        1
    }
    plain = Sampler.create(SamplingParams(seed=9), 0)
    zero = Sampler.create(SamplingParams(seed=9, min_p=0.0), 0)
    assert [plain(logits, p) for p in range(40)] == [zero(logits, p) for p in range(40)]


def stream_held(
    pieces: list[str], stops: tuple[str, ...], min_tokens: int, include: bool
) -> tuple[str, bool]:
    """Feed `pieces` as the engine feeds one token's text each, armed after `min_tokens`."""
    checker = StopChecker(stops, include=include)
    emitted = ""
    for count, piece in enumerate(pieces, 1):
        out, stopped = checker.feed(piece, armed=count > min_tokens)
        emitted += out
        if stopped:
            return emitted, True
    return emitted + checker.flush(), False


@given(
    pieces=st.lists(st.text(alphabet="ab\nU:", max_size=3), max_size=20),
    stops=st.lists(st.text(alphabet="ab\nU:", min_size=1, max_size=4), max_size=3),
    min_tokens=st.integers(0, 6),
    include=st.booleans(),
)
def test_stop_strings_end_the_text_only_after_min_tokens_and_may_stay_in_it(
    pieces: list[str], stops: list[str], min_tokens: int, include: bool
) -> None:
    """The cut is the first stop string that ends in a piece past the first `min_tokens`
    (earlier ones are passed over); `include` keeps the stop string."""
    full = "".join(pieces)
    armed_from = len("".join(pieces[:min_tokens]))  # the first character an armed piece adds
    expected: tuple[str, bool] = (full, False)
    for end in range(armed_from + 1, len(full) + 1):
        ending = [s for s in stops if full[:end].endswith(s)]
        if ending:
            expected = (full[: end if include else end - max(map(len, ending))], True)
            break
    assert stream_held(pieces, tuple(stops), min_tokens, include) == expected


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(min_p=0.25, min_tokens=3, max_tokens=9),
        SamplingParams(logit_bias=((0, -100.0), (7, 0.5), (511, 100.0)), allowed_token_ids=(7, 9)),
        SamplingParams(include_stop_str_in_output=True, skip_special_tokens=False, stop=("x",)),
        SamplingParams(bad_words=("fox", " lazy dog")),
    ],
)
def test_the_new_fields_survive_the_round_trip(params: SamplingParams) -> None:
    data = sampling_to_proto(params).SerializeToString()
    assert sampling_from_proto(serving_pb2.SamplingParams.FromString(data)) == params


def test_absent_fields_shape_nothing() -> None:
    got = sampling_from_proto(serving_pb2.SamplingParams())
    assert (got.min_p, got.min_tokens, got.logit_bias, got.allowed_token_ids) == (0, 0, (), ())
    assert got.skip_special_tokens and not got.include_stop_str_in_output
    assert LogitShaping.create(got, [EOS], 16) is None
    with pytest.raises(InvalidRequest) as refused:
        sampling_from_proto(serving_pb2.SamplingParams(allowed_token_ids=[-1]))
    assert refused.value.field == "sampling.allowed_token_ids"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_p=math.nan), "min_p"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(logit_bias=((512, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias"),
        (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias.3"),
        (SamplingParams(logit_bias=((3, math.nan),)), "logit_bias.3"),
        (SamplingParams(allowed_token_ids=(1, 512)), "allowed_token_ids"),
    ],
)
def test_each_bad_value_is_refused_by_name(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        params.validate(vocab_size=512, max_new_tokens=64)
    assert refused.value.field == field


def greedy_tokens(**sampling: object) -> list[int]:
    engine, recorder = recorded_engine(MODEL, EngineConfig(num_pages=64, page_size=4))
    engine.submit(greedy("run", PROMPT, 12, **sampling), recorder.outputs.append)
    drain(engine)
    return recorder.tokens("run")


def test_the_engine_draws_with_the_bias_and_within_the_allowed_tokens() -> None:
    plain = greedy_tokens(ignore_eos=True)
    first = plain[0]
    banned = greedy_tokens(ignore_eos=True, logit_bias=((first, -100.0),))
    assert banned[0] != first
    assert greedy_tokens(ignore_eos=True, logit_bias=((300, 100.0),)) == [300] * 12
    allowed = greedy_tokens(ignore_eos=True, allowed_token_ids=(40, 41, 42))
    assert set(allowed) <= {40, 41, 42} and len(allowed) == 12


def test_the_engine_generates_min_tokens_before_a_stop_token_ends_the_sample() -> None:
    plain = greedy_tokens(ignore_eos=True)
    stop = plain[2]
    ended = greedy_tokens(stop_token_ids=(stop,), ignore_eos=True)
    assert ended == plain[: plain.index(stop) + 1]
    held = greedy_tokens(stop_token_ids=(stop,), ignore_eos=True, min_tokens=6)
    assert len(held) >= 6 and stop not in held[:6]
    assert held[-1] == stop or len(held) == 12


def test_a_request_whose_allowed_tokens_min_tokens_holds_back_is_refused() -> None:
    engine, _ = recorded_engine(MODEL, EngineConfig(num_pages=64, page_size=4))
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(
            greedy("x", PROMPT, 8, allowed_token_ids=(EOS, 5), stop_token_ids=(5,), min_tokens=1),
            lambda _: None,
        )
    assert refused.value.field == "allowed_token_ids"
    engine.submit(  # with ignore_eos, EOS ends nothing, so min_tokens holds only 5
        greedy(
            "y",
            PROMPT,
            8,
            allowed_token_ids=(EOS, 5),
            stop_token_ids=(5,),
            min_tokens=1,
            ignore_eos=True,
        ),
        lambda _: None,
    )
    drain(engine)
