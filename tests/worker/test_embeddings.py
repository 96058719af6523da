"""Embedding requests in the engine (GenerateRequest.pooling): the embedding is the prompt's
last token's final hidden state as transformers computes it, cold or read from the prefix
cache; the prompt's KV is cached for what follows, generations beside it are unchanged, and
every bad request is refused naming its field, with every page accounted for."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from protos.radixmesh.v1 import serving_pb2, worker_pb2
from tests.worker.helpers import Recorder, drain, greedy, relative_error, served
from worker.engine import Engine, EngineConfig
from worker.error_details import refusal_of
from worker.errors import ContextOverflow, InvalidRequest
from worker.loader import LoadedModel
from worker.logit_shaping import LogitShaping
from worker.pooling import pooled
from worker.request import GenerateRequest, PoolingParams, RequestOutput, Resume
from worker.sampling_params import SamplingParams, StructuredOutput
from worker.validation import RequestLimits, validate

CONFIG = EngineConfig(
    num_pages=96, page_size=4, max_running=4, token_budget=48, max_prefill_chunk=16,
    max_model_len=128,
)  # fmt: skip
RAW = PoolingParams(normalize=False)


@pytest.fixture(scope="module")
def hf_model(tiny: LoadedModel) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModel.from_pretrained(tiny.path, dtype=torch.float32).eval()


def oracle(hf_model: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """transformers' final hidden state (after the last norm) at the prompt's last token."""
    with torch.no_grad():
        hidden: torch.Tensor = hf_model(torch.tensor([list(prompt)])).last_hidden_state
    return hidden[0, -1]


def embed(
    request_id: str, prompt: Sequence[int], params: PoolingParams = RAW, **fields: object
) -> GenerateRequest:
    return GenerateRequest(
        request_id,
        prompt_token_ids=tuple(prompt),
        pooling=params,
        **fields,  # type: ignore[arg-type]
    )


def run(engine: Engine, *requests: GenerateRequest) -> dict[str, list[RequestOutput]]:
    recorder = Recorder()
    for request in requests:
        engine.submit(request, recorder.outputs.append)
    drain(engine)
    check_sequence_cache(engine.cache)
    return recorder.by_request()


def vector(outputs: list[RequestOutput]) -> torch.Tensor:
    (output,) = outputs
    assert output.finished and output.finish_reason == "stop" and output.token_ids == ()
    return torch.tensor(output.embedding)


PROMPT = tuple(range(7, 7 + 45))


def test_an_embedding_is_transformers_last_hidden_state_cold_and_from_the_cache(
    tiny: LoadedModel, hf_model: torch.nn.Module
) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    expected = oracle(hf_model, PROMPT)
    cold = run(engine, embed("cold", PROMPT))["cold"]
    warm = run(engine, embed("warm", PROMPT))["warm"]  # the whole prompt is in the cache now
    assert cold[0].cached_prompt_tokens == 0 and warm[0].cached_prompt_tokens == 44
    assert cold[0].prompt_tokens == warm[0].prompt_tokens == len(PROMPT)
    for outputs in (cold, warm):
        assert relative_error(vector(outputs), expected) < 1e-5
    longer = (*PROMPT, 3, 4, 5)  # shares the cached prefix: only its 3 new tokens computed
    (hit,) = run(engine, embed("longer", longer))["longer"]
    assert hit.cached_prompt_tokens == 44
    assert relative_error(torch.tensor(hit.embedding), oracle(hf_model, longer)) < 1e-5


def test_dimensions_cut_then_normalise(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    raw = vector(run(engine, embed("raw", PROMPT))["raw"])
    unit = vector(run(engine, embed("unit", PROMPT, PoolingParams()))["unit"])
    short = vector(run(engine, embed("short", PROMPT, PoolingParams(dimensions=8)))["short"])
    assert raw.shape == (tiny.model.config.hidden_size,) and abs(float(raw.norm()) - 1) > 0.1
    assert torch.allclose(unit, raw / raw.norm(), atol=1e-6)
    assert short.shape == (8,) and float(short.norm()) == pytest.approx(1, abs=1e-6)
    assert torch.allclose(short, raw[:8] / raw[:8].norm(), atol=1e-6)
    row = torch.tensor([3.0, 4.0, 12.0])
    assert pooled(row, PoolingParams(dimensions=2)) == pytest.approx((0.6, 0.8))
    assert pooled(row, PoolingParams(dimensions=2, normalize=False)) == (3.0, 4.0)


def test_a_generation_reads_an_embedded_prompt_from_the_cache_and_is_unchanged_beside_one(
    tiny: LoadedModel,
) -> None:
    alone = Engine(tiny.model, tiny.tokenizer, CONFIG)
    expected = run(alone, greedy("g", PROMPT, 8))["g"]
    reference = vector(run(alone, embed("e", PROMPT[:30]))["e"])
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    run(engine, embed("first", PROMPT))
    after = run(engine, greedy("g", PROMPT, 8))["g"]
    assert after[0].cached_prompt_tokens == 44  # the embedding's prompt, from the cache
    assert [o.token_ids for o in after] == [o.token_ids for o in expected]
    fresh = Engine(tiny.model, tiny.tokenizer, CONFIG)  # both in the same steps
    both = run(fresh, greedy("g", PROMPT, 8), embed("e", PROMPT[:30]))
    assert [o.token_ids for o in both["g"]] == [o.token_ids for o in expected]
    assert relative_error(vector(both["e"]), reference) < 1e-5


@settings(max_examples=15, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(0, 40), st.lists(st.integers(3, 250), min_size=1, max_size=20)),
        min_size=2,
        max_size=5,
    )
)
def test_embeddings_do_not_depend_on_what_the_cache_holds(
    tiny: LoadedModel, data: list[tuple[int, list[int]]]
) -> None:
    """Prompts that share random prefixes of one base, embedded one after another on one
    engine (each reading what the ones before left in the cache), each equal its embedding on
    a fresh engine."""
    base = list(range(20, 60))
    prompts = [base[:shared] + tail for shared, tail in data]
    engine = Engine(tiny.model, tiny.tokenizer, replace(CONFIG, num_pages=40))  # evicts too
    together = run(engine, *[embed(f"p{i}", p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        fresh = Engine(tiny.model, tiny.tokenizer, CONFIG)
        cold = vector(run(fresh, embed("cold", prompt))["cold"])
        assert relative_error(vector(together[f"p{i}"]), cold) < 1e-5, i


def test_bad_embedding_requests_are_refused_by_name_and_the_engine_serves_on(
    tiny: LoadedModel,
) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    hidden = tiny.model.config.hidden_size
    refused: list[tuple[GenerateRequest, str]] = [
        (embed("n", PROMPT, sampling=SamplingParams(n=2)), "n"),
        (embed("lp", PROMPT, sampling=SamplingParams(logprobs=2)), "logprobs"),
        (embed("plp", PROMPT, sampling=SamplingParams(prompt_logprobs=1)), "prompt_logprobs"),
        (
            embed(
                "js", PROMPT, sampling=SamplingParams(structured=StructuredOutput("json_object"))
            ),
            "structured",
        ),
        (embed("zero", PROMPT, PoolingParams(dimensions=0)), "dimensions"),
        (embed("wide", PROMPT, PoolingParams(dimensions=hidden + 1)), "dimensions"),
        (embed("empty", ()), "prompt"),
        (embed("vocab", (1, 2, 10**6)), "prompt_token_ids"),
        (embed("resumed", PROMPT, resume=Resume(0, 1)), "resume"),
    ]
    for request, field in refused:
        with pytest.raises(InvalidRequest) as err:
            engine.submit(request, lambda _: None)
        assert err.value.field == field, request.request_id
    with pytest.raises(ContextOverflow) as overflow:  # one token past the context
        engine.submit(embed("long", range(3, 3 + 129)), lambda _: None)
    assert overflow.value.field == "input" and "129 tokens" in str(overflow.value)
    assert not engine.stats().waiting
    whole = tuple(3 + i % 200 for i in range(128))  # all of the context: nothing is generated
    (fits,) = run(engine, embed("fits", whole))["fits"]
    assert len(fits.embedding) == hidden
    assert run(engine, greedy("after", PROMPT, 4))["after"][-1].finished


def test_the_worker_service_streams_one_message_holding_the_embedding(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    expected = vector(
        run(engine, embed("reference", PROMPT, PoolingParams(dimensions=16)))["reference"]
    )

    async def scenario() -> None:
        async with served(engine) as stub:
            call = worker_pb2.WorkerGenerateRequest(
                request_id="wire",
                token_ids=PROMPT,
                pooling=serving_pb2.PoolingParams(dimensions=16),
            )
            (message,) = [m async for m in stub.Generate(call)]
            assert message.finished and message.finish_reason == "stop"
            assert not message.token_ids and message.cached_prompt_tokens == 44
            assert relative_error(torch.tensor(list(message.embedding)), expected) < 1e-6
            call.request_id, call.pooling.dimensions = "wide", 10**6
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(call):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refusal_of(err.value) == ("dimensions", None)

    asyncio.run(scenario())
    check_sequence_cache(engine.cache)


def test_sampling_fields_an_embedding_does_not_use_are_dropped(tiny: LoadedModel) -> None:
    """An allowed token, a bias or a bad word outside what the model could draw would fail
    the sampler's making; an embedding draws nothing, so none is made of them."""
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    plain = vector(run(engine, embed("plain", PROMPT))["plain"])
    odd = SamplingParams(allowed_token_ids=[10**6], logit_bias={10**6: 1.0}, bad_words=["zz"])
    asked = vector(run(engine, embed("odd", PROMPT, sampling=odd))["odd"])
    assert relative_error(asked, plain) < 1e-5
    assert not engine.stats().running and not engine.stats().waiting


def test_a_router_with_a_worker_from_before_embeddings_refuses_them_by_name() -> None:
    limits = RequestLimits(vocab_size=256, max_model_len=64)  # hidden_size 0: not told
    with pytest.raises(InvalidRequest) as err:
        validate(embed("old", PROMPT[:10]), PROMPT[:10], limits)
    assert err.value.field == "pooling"
    validate(embed("new", PROMPT[:10]), PROMPT[:10], replace(limits, hidden_size=64))


def test_a_request_the_engine_fails_to_add_ends_in_an_error_and_frees_its_id(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault: making a request's samples raises (a bug). The request ends with an error on
    every sample, the engine serves on, and the id can be used again."""
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    real = LogitShaping.create
    calls = iter([True])

    def failing_once(*args: object, **kwargs: object) -> object:
        if next(calls, False):
            raise RuntimeError("injected")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LogitShaping, "create", staticmethod(failing_once))
    two = SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1)
    outputs = run(engine, GenerateRequest("x", prompt_token_ids=PROMPT, sampling=two))["x"]
    assert sorted(o.index for o in outputs) == [0, 1]
    assert all(
        o.finished and o.finish_reason == "error" and "injected" in (o.error or "") for o in outputs
    )
    again = run(engine, greedy("x", PROMPT, 3))["x"]
    assert again[-1].finished and again[-1].finish_reason == "length"
