"""lm-evaluation-harness's own OpenAI-completions client (`local-completions`,
`LocalCompletionsAPI`) against the router's HTTP API: its loglikelihood requests (echo with
logprobs, a batch of token-id prompts in one request) and its generate_until, parsed by the
harness itself. The loglikelihoods must equal what each continuation token gets when it is the
one token allowed after its prefix; the greedy flags, whether each is the most likely there."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2 as httpx
import pytest
from lm_eval.api import instance as lm_eval_api
from lm_eval.models import openai_completions

from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

PAIRS = [
    ("the quick brown", " fox jumps"),
    ("over the lazy", " dog"),
    ("a cache keeps", " the prefix of every prompt"),
]


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def harness(cluster: LocalCluster, tiny: LoadedModel, batch_size: int) -> object:
    return openai_completions.LocalCompletionsAPI(
        model=SERVED_NAME,
        base_url=f"{cluster.http_url}/v1/completions",
        tokenizer=str(tiny.path),
        tokenizer_backend="huggingface",
        batch_size=batch_size,
        max_retries=1,
        max_gen_toks=8,
    )


def instances(kind: str, arguments: list[tuple[object, ...]]) -> list[object]:
    return [
        lm_eval_api.Instance(request_type=kind, doc={}, arguments=args, idx=i)
        for i, args in enumerate(arguments)
    ]


def allowed_logprob(cluster: LocalCluster, prefix: list[int], token: int) -> tuple[float, bool]:
    """`token`'s logprob after `prefix`, drawn as the only token allowed (the decode path's
    logprob of a sampled token, not the prompt scoring under test), and whether it is the most
    likely token there (its own entry is the best of the top one)."""
    body = {
        "model": SERVED_NAME,
        "prompt": prefix,
        "max_tokens": 1,
        "logprobs": 1,
        "allowed_token_ids": [token],
        "ignore_eos": True,
    }
    choice = httpx.post(f"{cluster.http_url}/v1/completions", json=body).json()["choices"][0]
    logprob = choice["logprobs"]["token_logprobs"][0]
    return logprob, logprob >= max(choice["logprobs"]["top_logprobs"][0].values())


@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_harness_loglikelihoods_are_the_models(
    cluster: LocalCluster, tiny: LoadedModel, batch_size: int
) -> None:
    lm = harness(cluster, tiny, batch_size)
    results = lm.loglikelihood(instances("loglikelihood", PAIRS), disable_tqdm=True)  # type: ignore[attr-defined]
    assert len(results) == len(PAIRS)
    tokenizer = tiny.tokenizer
    assert tokenizer is not None
    for (context, continuation), (total, greedy) in zip(PAIRS, results, strict=True):
        ids = tokenizer.encode(context, add_special_tokens=False)
        tail = tokenizer.encode(context + continuation, add_special_tokens=False)[len(ids) :]
        scored = [allowed_logprob(cluster, ids + tail[:i], tail[i]) for i in range(len(tail))]
        assert total == pytest.approx(sum(lp for lp, _ in scored), abs=1e-3)
        assert greedy == all(best for _, best in scored)
    assert_no_leak(cluster)


def test_the_harness_generate_until_stops_at_its_strings(
    cluster: LocalCluster, tiny: LoadedModel
) -> None:
    lm = harness(cluster, tiny, 2)
    free = lm.generate_until(  # type: ignore[attr-defined]
        instances(
            "generate_until", [(c, {"until": ["\n\n\n"], "max_gen_toks": 8}) for c, _ in PAIRS]
        ),
        disable_tqdm=True,
    )
    assert len(free) == len(PAIRS) and all(isinstance(text, str) for text in free)
    stop = next(text[1] for text in free if len(text) > 2)
    cut = lm.generate_until(  # type: ignore[attr-defined]
        instances("generate_until", [(c, {"until": [stop], "max_gen_toks": 8}) for c, _ in PAIRS]),
        disable_tqdm=True,
    )
    for whole, short in zip(free, cut, strict=True):
        assert stop not in short and whole.startswith(short)
    assert_no_leak(cluster)


def test_the_harness_needs_no_tokenizer_of_its_own(
    cluster: LocalCluster, tiny: LoadedModel
) -> None:
    """`tokenizer_backend=remote`: the harness tokenizes with /tokenize and /detokenize after
    reading /tokenizer_info, and scores what it scores with the checkpoint's tokenizer."""
    info = httpx.get(f"{cluster.http_url}/tokenizer_info").json()
    assert tiny.tokenizer is not None
    assert info["eos_token"] == tiny.tokenizer.eos_token == "<|im_end|>"
    assert info["chat_template"] == tiny.tokenizer.chat_template
    assert info["model_max_length"] == cluster.config.engine.max_model_len
    remote = openai_completions.LocalCompletionsAPI(
        model=SERVED_NAME,
        base_url=f"{cluster.http_url}/v1/completions",
        tokenizer_backend="remote",
        batch_size=3,
        max_retries=1,
    )
    pairs = instances("loglikelihood", PAIRS)
    got = remote.loglikelihood(pairs, disable_tqdm=True)
    expected = harness(cluster, tiny, 1).loglikelihood(pairs, disable_tqdm=True)  # type: ignore[attr-defined]
    assert [g for _, g in got] == [g for _, g in expected]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in expected], abs=1e-4)
    assert_no_leak(cluster)
