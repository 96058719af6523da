"""Logprobs: each streamed token carries its log-probability and the most likely tokens at its
position, computed from the raw logits the engine drew it from (before penalties and
temperature), and nothing is computed or sent when a request does not ask."""

from __future__ import annotations

import torch

from tests.worker.helpers import LLAMA, Recorder, drain, recorded_engine
from worker.engine import Engine, EngineConfig
from worker.request import FINISH_ABORT, FINISH_STOP, GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

MODEL = tiny_model(LLAMA, seed=5)
PROMPT = (1, 17, 30, 99, 250, 17, 4)


def run(max_tokens: int = 12, **sampling: object) -> tuple[list[RequestOutput], Recorder]:
    engine, recorder = recorded_engine(MODEL, EngineConfig(num_pages=64, page_size=4))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    engine.submit(GenerateRequest("r", PROMPT, sampling=params), recorder.outputs.append)
    drain(engine)
    return recorder.outputs, recorder


def check_against_logits(outputs: list[RequestOutput], recorder: Recorder, top: int) -> None:
    """Every token's logprobs are log_softmax of the raw row it was drawn from."""
    for index in {o.index for o in outputs}:
        mine = [o for o in outputs if o.index == index]
        tokens = [t for o in mine for t in o.token_ids]
        logprobs = [lp for o in mine for lp in o.logprobs]
        assert all(len(o.logprobs) == len(o.token_ids) for o in mine)
        assert len(logprobs) == len(tokens) > 0
        for i, (token, got) in enumerate(zip(tokens, logprobs, strict=True)):
            row = recorder.logits[("r", index, len(PROMPT) + i)]
            expected = torch.log_softmax(row.float(), dim=-1)
            assert abs(got.logprob - float(expected[token])) < 1e-6
            ids = [t for t, _ in got.top]
            values = [v for _, v in got.top]
            assert len(got.top) == top
            assert values == sorted(values, reverse=True)
            assert ids == torch.topk(expected, top).indices.tolist()
            torch.testing.assert_close(torch.tensor(values), expected[ids], rtol=0, atol=1e-6)
            if top:
                assert ids[0] == int(torch.argmax(row))
            if token in ids:
                assert got.top[ids.index(token)][1] == got.logprob


def test_sampled_tokens_carry_the_logprobs_of_the_logits_they_were_drawn_from() -> None:
    outputs, recorder = run(temperature=1.3, top_k=40, seed=3, logprobs=5, n=3)
    check_against_logits(outputs, recorder, top=5)
    chosen = [lp.logprob for o in outputs for lp in o.logprobs]
    best = [lp.top[0][1] for o in outputs for lp in o.logprobs]
    assert any(c < b for c, b in zip(chosen, best, strict=True)), "sampling picks runners-up"


def test_a_greedy_token_is_the_first_of_the_top_list() -> None:
    outputs, recorder = run(temperature=0.0, logprobs=3)
    check_against_logits(outputs, recorder, top=3)
    for output in outputs:
        ((logprob,), (token,)) = output.logprobs, output.token_ids
        assert logprob.top[0] == (token, logprob.logprob)


def test_logprobs_0_gives_the_chosen_token_alone_and_none_asked_gives_none() -> None:
    outputs, recorder = run(temperature=1.0, seed=4, logprobs=0)
    check_against_logits(outputs, recorder, top=0)
    assert all(lp.top == () for o in outputs for lp in o.logprobs)
    plain, _ = run(temperature=1.0, seed=4)
    assert [o.token_ids for o in plain] == [o.token_ids for o in outputs]
    assert all(o.logprobs == () for o in plain)


def test_logprobs_are_raw_not_penalized() -> None:
    """vLLM's default: what the model gave, before penalties; the greedy pick then need not
    be the raw top token."""
    outputs, recorder = run(max_tokens=40, temperature=0.0, logprobs=2, presence_penalty=2.0)
    check_against_logits(outputs, recorder, top=2)
    raw_best = [(o.logprobs[0].top[0][0], o.token_ids[0]) for o in outputs]
    assert any(best != token for best, token in raw_best), "the penalty should move a pick"


def test_a_stop_token_has_its_logprob_and_an_abort_ends_with_none() -> None:
    free, _ = run(temperature=0.0)
    stop = free[5].token_ids[0]
    outputs, recorder = run(temperature=0.0, logprobs=1, stop_token_ids=(stop,))
    check_against_logits(outputs, recorder, top=1)
    assert outputs[-1].finish_reason == FINISH_STOP
    assert outputs[-1].token_ids == (stop,) and len(outputs[-1].logprobs) == 1

    engine = Engine(MODEL, None, EngineConfig(num_pages=64, page_size=4))
    got: list[RequestOutput] = []
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2)
    engine.submit(GenerateRequest("a", PROMPT, sampling=params), got.append)
    for _ in range(4):
        engine.step()
    engine.abort("a")
    drain(engine)
    assert got[-1].finish_reason == FINISH_ABORT
    assert (got[-1].token_ids, got[-1].logprobs) == ((), ())
    assert all(len(o.logprobs) == 1 for o in got[:-1]) and len(got) > 1
