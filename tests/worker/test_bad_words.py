"""vLLM's bad_words: the words spelled as vLLM spells them (alone, and after a space), the ban
against a from-scratch reference over random histories, a resumed sample banning as the first
would, the engine on the tiny model never writing a banned sequence, and bans that leave no
token ending their request with an error that says so."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from tests.worker.helpers import drain
from worker.bad_words import BadWords, bad_word_ids
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.logit_shaping import LogitShaping
from worker.request import GenerateRequest, RequestOutput
from worker.sampling import NothingToDraw, Sampler
from worker.sampling_params import SamplingParams

SEQUENCES = st.lists(
    st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4
).map(tuple)


@given(sequences=SEQUENCES, history=st.lists(st.integers(0, 5), max_size=10))
def test_the_ban_is_each_sequence_whose_rest_the_history_ends_with(
    sequences: tuple[tuple[int, ...], ...], history: list[int]
) -> None:
    words = BadWords.create(sequences)
    assert words is not None
    words.replay(history)
    expected = {
        s[-1]
        for s in sequences
        if len(s) - 1 <= len(history) and (len(s) == 1 or history[-(len(s) - 1) :] == list(s[:-1]))
    }
    assert set(words.banned()) == expected
    row = torch.zeros(6)
    masked = words.apply(row, owned=False)
    assert {i for i in range(6) if masked[i] == float("-inf")} == expected
    assert row.tolist() == [0.0] * 6, "a row it does not own stays as it is"


@given(sequences=SEQUENCES, seed=st.integers(0, 2**32), steps=st.integers(0, 6))
def test_no_banned_sequence_is_ever_drawn_and_a_resumed_sampler_draws_the_same(
    sequences: tuple[tuple[int, ...], ...], seed: int, steps: int
) -> None:
    if any(len(s) == 1 for s in sequences) and {s[0] for s in sequences if len(s) == 1} == set(
        range(6)
    ):
        return  # every token banned: no draw is possible
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=32)
    logits = torch.linspace(2.0, -2.0, 6)
    first = Sampler.create(params, 0, bad_words=BadWords.create(sequences))
    drawn = [first(logits, p) for p in range(steps + 8)]
    for s in sequences:
        windows = [tuple(drawn[i : i + len(s)]) for i in range(len(drawn) - len(s) + 1)]
        assert s not in windows
    later = Sampler.create(params, 0, bad_words=BadWords.create(sequences))
    later.replay(drawn[:steps])
    assert [later(logits, steps + k) for k in range(8)] == drawn[steps:]


def test_words_are_spelled_alone_and_after_a_space(tiny: LoadedModel) -> None:
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    (alone, *rest) = bad_word_ids(["fox"], tokenizer, 512)
    assert alone == tuple(tokenizer.encode("fox", add_special_tokens=False))
    spaced = tuple(tokenizer.encode(" fox", add_special_tokens=False))
    assert rest == ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    with pytest.raises(InvalidRequest) as refused:
        bad_word_ids(["fox"], None, 512)
    assert refused.value.field == "bad_words"


def test_the_engine_never_writes_a_banned_word(tiny: LoadedModel) -> None:
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    config = EngineConfig(num_pages=64, page_size=4, model_revision=tiny.revision)

    def run(**sampling: object) -> list[int]:
        engine = Engine(tiny.model, tokenizer, config)
        outputs: list[RequestOutput] = []
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **sampling)  # type: ignore[arg-type]
        engine.submit(
            GenerateRequest("r", prompt="the quick brown", sampling=params), outputs.append
        )
        drain(engine)
        return [t for o in outputs for t in o.token_ids]

    plain = run()
    vocab = tiny.config.vocab_size
    # two tokens the greedy answer writes that spell a word as vLLM spells it
    word, banned = next(
        (w, ids)
        for i in range(len(plain) - 1)
        if (w := tokenizer.decode(plain[i : i + 2])).strip()
        and tuple(plain[i : i + 2]) in (ids := bad_word_ids([w], tokenizer, vocab))
    )
    tokens = run(bad_words=(word,))
    assert tokens != plain
    for sequence in banned:
        windows = {tuple(tokens[i : i + len(sequence)]) for i in range(len(tokens))}
        assert sequence not in windows, (word, sequence)
    with pytest.raises(InvalidRequest) as refused:
        run(bad_words=("  ",))
    assert refused.value.field == "bad_words[0]"


def test_bans_that_leave_nothing_end_the_request_with_a_clear_error(tiny: LoadedModel) -> None:
    """allowed_token_ids [t] with bad word "tt": the first t is drawn, then nothing can be.
    The engine ends that request alone (an error naming the bans) and keeps serving; bans
    that exclude every allowed token from the start are refused when the request arrives."""
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    vocab = tiny.config.vocab_size

    def spelled(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    token, piece = next(
        (t, p)
        for t in range(3, vocab)
        if (p := tokenizer.decode([t])).strip()
        and not p.startswith(" ")
        and spelled(p) == (t,)
        and spelled(p + p) == (t, t)
        and bad_word_ids([p + p], tokenizer, vocab) == ((t, t),)
    )
    config = EngineConfig(num_pages=64, page_size=4, model_revision=tiny.revision)
    engine = Engine(tiny.model, tokenizer, config)
    for temperature in (0.0, 1.0):
        outputs: list[RequestOutput] = []
        params = SamplingParams(
            max_tokens=8,
            temperature=temperature,
            ignore_eos=True,
            allowed_token_ids=(token,),
            bad_words=(piece + piece,),
        )
        rid = f"banned-{temperature}"
        engine.submit(GenerateRequest(rid, prompt="the quick", sampling=params), outputs.append)
        drain(engine)
        assert [t for o in outputs for t in o.token_ids] == [token]
        assert outputs[-1].finish_reason == "error"
        assert outputs[-1].error is not None and "nothing can be drawn" in outputs[-1].error
    check_sequence_cache(engine.cache)
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(
            GenerateRequest(
                "refused",
                prompt="the quick",
                sampling=SamplingParams(allowed_token_ids=(token,), bad_words=(piece,)),
            ),
            lambda _: None,
        )
    assert refused.value.field == "bad_words"


def test_a_sampler_whose_bans_leave_nothing_says_so() -> None:
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, allowed_token_ids=(1,))
        shaping = LogitShaping.create(params, [], 4)
        draw = Sampler.create(params, 0, shaping=shaping, bad_words=BadWords.create(((1, 1),)))
        row = torch.tensor([3.0, 0.0, 1.0, 2.0])
        assert draw(row, 0) == 1
        with pytest.raises(NothingToDraw):
            draw(row, 1)


def test_allowed_tokens_banned_or_held_between_them_are_refused_at_submit(
    tiny: LoadedModel,
) -> None:
    """Allowed tokens that bad_words ban one-token words of and min_tokens holds back the rest
    of leave nothing to draw: refused at submit naming both fields, as either alone is, not
    failed after the prefill. Each ban alone leaves a token, and that request is served."""
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    engine = Engine(tiny.model, tokenizer, EngineConfig(num_pages=64, page_size=4))
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    (eos,) = engine.eos_token_ids
    both = SamplingParams(
        max_tokens=3, temperature=0, allowed_token_ids=(eos, a), bad_words=("a",), min_tokens=1
    )
    with pytest.raises(InvalidRequest, match="min_tokens 1 holds back the rest") as refused:
        engine.submit(GenerateRequest("x", (5, 6, 7), sampling=both), lambda _: None)
    assert refused.value.field == "bad_words"
    assert not engine.active_requests
    outputs: list[RequestOutput] = []
    for rid, sampling in {
        "banned": dataclasses.replace(both, min_tokens=0),  # EOS ends it at once
        "held": dataclasses.replace(both, bad_words=()),  # a first, EOS held back
        "x": dataclasses.replace(both, ignore_eos=True),  # the refused id; EOS is not held
    }.items():
        engine.submit(GenerateRequest(rid, (5, 6, 7), sampling=sampling), outputs.append)
    drain(engine)
    finals = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finals == {"banned": "stop", "held": "length", "x": "length"}
    held = [t for o in outputs if o.request_id == "held" for t in o.token_ids]
    assert held[0] == a
    assert not engine.active_requests and engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)
