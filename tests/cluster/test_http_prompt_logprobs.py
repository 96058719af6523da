"""A prompt's logprobs over HTTP: OpenAI's `echo` with `logprobs` as lm-evaluation-harness sends
it for loglikelihood tasks, checked against the logprob each token gets when it is the one
token allowed after its prefix, and vLLM's `prompt_logprobs`, through the `openai` SDK and raw
HTTP on loopback to a local cluster of two tiny-model workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak, grpc_tokens
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def ids_of(cluster: LocalCluster, text: str) -> list[int]:
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    return tokenizer.encode(text)


def forced_logprob(client: openai.OpenAI, prefix: list[int], token: int) -> float:
    """`token`'s logprob after `prefix`: the only token allowed, drawn, and its raw logprob."""
    answer = client.completions.create(
        model=MODEL,
        prompt=prefix,
        max_tokens=1,
        temperature=0,
        logprobs=0,
        extra_body={"allowed_token_ids": [token], "ignore_eos": True},
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    value = logprobs.token_logprobs[0]
    assert value is not None
    return value


def test_lm_eval_loglikelihood_request_scores_the_continuation(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """lm-evaluation-harness's `local-completions` payload and its parse_logprobs."""
    context, continuation = ids_of(cluster, "the quick brown"), ids_of(cluster, " fox jumps")
    ids = context + continuation
    payload = {
        "model": MODEL,
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json=payload)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    ctxlen = len(context)
    scores = logprobs["token_logprobs"][ctxlen:-1]
    tops = logprobs["top_logprobs"][ctxlen:-1]
    is_greedy = all(score == max(top.values()) for score, top in zip(scores, tops, strict=True))
    expected = [forced_logprob(client, ids[:i], ids[i]) for i in range(ctxlen, len(ids))]
    assert scores == pytest.approx(expected, abs=1e-4)
    ranked = httpx.post(
        f"{cluster.http_url}/v1/completions", json={**payload, "prompt_logprobs": 0}
    ).json()["choices"][0]["prompt_logprobs"]
    ranks = [ranked[i][str(ids[i])]["rank"] for i in range(ctxlen, len(ids))]
    assert is_greedy == all(rank == 1 for rank in ranks)
    texts = cluster.links.tokenizer
    assert texts is not None
    assert choice["text"].startswith(texts.decode(ids, skip_special_tokens=False))
    assert_no_leak(cluster)


def test_a_greedy_continuation_scores_as_greedy(cluster: LocalCluster) -> None:
    context = ids_of(cluster, "the quick brown")
    continuation = grpc_tokens(cluster, text="the quick brown")  # what greedy decoding wrote
    payload = {
        "model": MODEL,
        "prompt": [context + continuation],
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
    }
    logprobs = httpx.post(f"{cluster.http_url}/v1/completions", json=payload).json()
    choice = logprobs["choices"][0]["logprobs"]
    scores, tops = choice["token_logprobs"][len(context) : -1], choice["top_logprobs"]
    assert len(scores) == len(continuation) == 8
    for score, top in zip(scores, tops[len(context) : -1], strict=True):
        assert score == max(top.values())


def test_echo_through_the_sdk_leads_with_the_prompt_streamed_or_not(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    ask: dict[str, Any] = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **ask)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, **ask)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.text_offset is not None
    prompt_tokens = len(ids_of(cluster, PROMPT))
    assert len(logprobs.tokens) == prompt_tokens + 5
    assert "".join(logprobs.tokens[:prompt_tokens]) == PROMPT
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[prompt_tokens] == len(PROMPT)
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    # each entry holds the token itself and its 2 alternatives (OpenAI: up to logprobs + 1)
    for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:], strict=True):
        assert top is not None and token in top and 1 <= len(top) <= 3
    streamed_text, streamed_tokens = "", []
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, stream=True, **ask
    ):
        for c in chunk.choices:
            streamed_text += c.text
            streamed_tokens += c.logprobs.tokens if c.logprobs and c.logprobs.tokens else []
    assert streamed_text == choice.text and streamed_tokens == logprobs.tokens
    bare = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, **ask)
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None
    assert bare.usage is not None and bare.usage.prompt_tokens_details is not None
    assert bare.usage.prompt_tokens_details.cached_tokens > 0, "echo alone scores nothing"
    assert_no_leak(cluster)


def test_vllm_prompt_logprobs_on_completions_and_chat(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=0,
        n=1,
        extra_body={"prompt_logprobs": 3},
    )
    entries = answer.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    ids = ids_of(cluster, PROMPT)
    assert len(entries) == len(ids) and entries[0] is None
    echoed = answer.choices[0].logprobs
    assert echoed is not None and echoed.token_logprobs is not None
    for i, entry in enumerate(entries[1:], 1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(echoed.token_logprobs[i], abs=1e-6)
        assert own["decoded_token"] == echoed.tokens[i]  # type: ignore[index]
        # the token itself and its 3 most likely alternatives, ranked 1, 2, 3
        assert {e["rank"] for e in entry.values()} == {1, 2, 3, own["rank"]}
        assert len(entry) == (3 if own["rank"] <= 3 else 4)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    scored = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(scored) == chat.usage.prompt_tokens
    assert scored[0] is None and all(len(e) == 1 for e in scored[1:])
    assert chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0, "a scored prompt is computed whole"
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2
    )
    assert plain.model_extra.get("prompt_logprobs") is None  # type: ignore[union-attr]
    assert_no_leak(cluster)


def test_every_choice_of_n_echoes_the_prompt_with_its_logprobs(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        n=3,
        temperature=1.0,
        seed=2,
        echo=True,
        logprobs=1,
    )
    prompt_tokens = len(ids_of(cluster, PROMPT))
    firsts = []
    for choice in answer.choices:
        assert choice.text.startswith(PROMPT)
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        firsts.append(choice.logprobs.token_logprobs[:prompt_tokens])
    assert firsts[0][0] is None and firsts[0] == firsts[1] == firsts[2]
    assert_no_leak(cluster)


def test_a_one_token_prompt_echoes_with_its_null_entry(cluster: LocalCluster) -> None:
    token = ids_of(cluster, PROMPT)[0]
    body = {"model": MODEL, "prompt": [token], "max_tokens": 2, "echo": True, "logprobs": 1}
    body["ignore_eos"] = True  # two tokens generated, never fewer
    choice = httpx.post(f"{cluster.http_url}/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == 3 and logprobs["token_logprobs"][0] is None
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert_no_leak(cluster)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """OpenAI's legacy way to score a text (vLLM serves it): the prompt, its logprobs, nothing
    generated."""
    scored = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, n=2, temperature=1.0
    )
    prompt_tokens = len(ids_of(cluster, PROMPT))
    with_one = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1
    )
    expected = with_one.choices[0].logprobs
    assert expected is not None and expected.token_logprobs is not None
    for choice in scored.choices:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.tokens is not None
        assert logprobs.tokens == expected.tokens[:prompt_tokens]  # type: ignore[index]
        assert logprobs.token_logprobs == expected.token_logprobs[:prompt_tokens]
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    streamed = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT
    refused = httpx.post(
        f"{cluster.http_url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert_no_leak(cluster)
