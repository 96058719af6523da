"""vLLM's prompt_logprobs on the engine: each prompt token's log-probability and rank under the
tokens before it, against a reference that runs the model on every prefix of the prompt alone;
the whole prompt computed (nothing reused from the cache, then cached for the next request),
in chunks or not; on the first output of the first sample only; not for a resumed sample."""

from __future__ import annotations

import pytest
import torch

from tests.worker.helpers import LLAMA, drain, greedy, recorded_engine
from worker.engine import EngineConfig
from worker.errors import InvalidRequest
from worker.logprobs import prompt_logprobs
from worker.model_runner import Chunk, ModelRunner
from worker.request import GenerateRequest, RequestOutput, Resume, TokenLogprob
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

MODEL = tiny_model(LLAMA, seed=5)
PROMPT = [1, 17, 30, 99, 250, 17, 4, 61, 61, 300, 12, 7, 480, 33, 5, 90, 17, 30, 99]


def reference(prompt: list[int], top: int) -> list[TokenLogprob]:
    """Token i's entry from the logits of the prefix prompt[:i] run alone, its last row only."""
    out = []
    for i in range(1, len(prompt)):
        runner = ModelRunner(MODEL, num_pages=i + 2, page_size=1)
        row = runner.run([Chunk(prompt[:i], 0, list(range(1, i + 1)), True)])[0]
        logprobs = torch.log_softmax(row.double(), dim=-1)
        best = torch.topk(logprobs, top)
        rank = int((logprobs > logprobs[prompt[i]]).sum()) + 1
        pairs = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True))
        out.append(TokenLogprob(float(logprobs[prompt[i]]), pairs, rank))
    return out


def assert_close(got: tuple[TokenLogprob, ...], expected: list[TokenLogprob]) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4), f"token {i + 1}"
        assert a.rank == b.rank, f"token {i + 1}"
        assert [t for t, _ in a.top] == [t for t, _ in b.top], f"token {i + 1}"
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def scored(config: EngineConfig, *requests: GenerateRequest) -> dict[str, list[RequestOutput]]:
    engine, recorder = recorded_engine(MODEL, config)
    for request in requests:
        engine.submit(request, recorder.outputs.append)
        drain(engine)
    return recorder.by_request()


CONFIG = EngineConfig(num_pages=64, page_size=4)


@pytest.mark.parametrize("chunk", [512, 5], ids=["whole", "chunks of 5"])
def test_prompt_logprobs_equal_the_model_run_on_each_prefix(chunk: int) -> None:
    config = EngineConfig(num_pages=64, page_size=4, max_prefill_chunk=chunk, token_budget=chunk)
    outputs = scored(config, greedy("p", PROMPT, 3, prompt_logprobs=4))["p"]
    first, *rest = outputs
    assert_close(first.prompt_logprobs, reference(PROMPT, 4))
    assert first.prompt_token_ids == tuple(PROMPT)
    assert all(not o.prompt_logprobs for o in rest), "sent once, with the first token"
    assert all(e.rank >= 1 for e in first.prompt_logprobs)
    assert any(e.rank > 1 for e in first.prompt_logprobs), "a random model's prompt is no argmax"


def test_a_scored_prompt_is_computed_whole_then_cached_for_the_next() -> None:
    warm = scored(
        CONFIG, greedy("plain", PROMPT, 3), greedy("scored", PROMPT, 3, prompt_logprobs=0)
    )
    assert warm["plain"][0].cached_prompt_tokens == 0
    scored_first = warm["scored"][0]
    assert scored_first.cached_prompt_tokens == 0, "scoring reuses nothing, cached or not"
    assert [e.top for e in scored_first.prompt_logprobs] == [()] * (len(PROMPT) - 1)
    assert_close(scored_first.prompt_logprobs, [replace_top(e) for e in reference(PROMPT, 1)])
    cold = scored(  # on an empty cache, the scored request's pages are what the next one finds
        CONFIG, greedy("scored", PROMPT, 3, prompt_logprobs=0), greedy("after", PROMPT, 3)
    )
    assert cold["after"][0].cached_prompt_tokens >= len(PROMPT) - 4
    runs = [warm["plain"], warm["scored"], cold["scored"], cold["after"]]
    tokens = [[t for o in outputs for t in o.token_ids] for outputs in runs]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]


def replace_top(entry: TokenLogprob) -> TokenLogprob:
    return TokenLogprob(entry.logprob, (), entry.rank)


def test_only_the_first_sample_carries_them_and_a_resumed_sample_none() -> None:
    sampling = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=3, prompt_logprobs=2)
    request = GenerateRequest("n", prompt_token_ids=tuple(PROMPT), sampling=sampling)
    outputs = scored(CONFIG, request)
    carrying = [o.index for o in outputs["n"] if o.prompt_logprobs]
    assert carrying == [0]
    assert [o.index for o in outputs["n"] if o.prompt_token_ids] == [0]
    resumed = GenerateRequest(
        "resumed",
        prompt_token_ids=(*PROMPT, 9, 8),
        sampling=SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2),
        resume=Resume(0, 2),
    )
    again = scored(CONFIG, greedy("warm", PROMPT, 2), resumed)["resumed"]
    assert all(not o.prompt_logprobs for o in again)
    assert again[0].cached_prompt_tokens > 0, "a resumed sample reuses the cache as usual"


def test_one_token_prompt_has_nothing_to_score_and_still_sends_its_id() -> None:
    (first, *_) = scored(CONFIG, greedy("one", [5], 2, prompt_logprobs=3))["one"]
    assert first.prompt_logprobs == () and first.prompt_token_ids == (5,)


def test_the_rows_reading_gives_ranks_and_top_in_order() -> None:
    rows = torch.tensor([[0.0, 2.0, 1.0, 3.0], [5.0, 5.0, 1.0, 0.0]])
    first, second = prompt_logprobs(rows, [2, 1], 2)
    assert first.rank == 3 and [t for t, _ in first.top] == [3, 1]
    assert second.rank == 1, "a tie with the best is rank 1"
    assert first.logprob == pytest.approx(float(torch.log_softmax(rows[0], -1)[2]))


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_refused_by_name(value: int) -> None:
    engine, _ = recorded_engine(MODEL, CONFIG)
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(greedy("x", PROMPT, 2, prompt_logprobs=value), lambda _: None)
    assert refused.value.field == "prompt_logprobs"
