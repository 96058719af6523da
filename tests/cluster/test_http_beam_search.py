"""vLLM's beam search (`use_beam_search`) through the `openai` SDK over real HTTP on loopback
to a local cluster of two tiny-model workers: the beams equal those of a search written out
here over SGLang's `/generate` (each step's top logprobs by token id), on text completions of
one and several prompts and on chat; one beam is greedy decoding; each step after the first
reads the prompt from the cache; what beam search does not do is refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import httpx2 as httpx
import openai
import pytest

from cluster.http.beam_search import MAX_WIDTH
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.test_http_sglang_generate import ended
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
BEAMS = {"use_beam_search": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny)


def top(cluster: LocalCluster, ids: Sequence[int], k: int) -> list[tuple[float, int]]:
    """The k most likely next tokens after `ids`, by SGLang's API: (logprob, id)."""
    body = {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": k,
    }
    answer = httpx.post(f"{cluster.http_url}/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return [(lp, token) for lp, token, _ in answer.json()["meta_info"]["output_top_logprobs"][0]]


def searched(
    cluster: LocalCluster,
    prompt: list[int],
    width: int,
    steps: int,
    eos: frozenset[int] = frozenset(),
    length_penalty: float = 1.0,
) -> list[tuple[tuple[int, ...], float]]:
    """vLLM's beam search written out: the best `width` (tokens, cumulative logprob)."""
    live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
    ended: list[tuple[tuple[int, ...], float]] = []
    for _ in range(steps):
        grown = []
        for tokens, total in live:
            for logprob, token in top(cluster, [*prompt, *tokens], 2 * width):
                if token in eos:
                    ended.append((tokens, total + logprob))
                else:
                    grown.append(((*tokens, token), total + logprob))
        live = sorted(grown, key=lambda beam: beam[1], reverse=True)[:width]
        if not live:
            break
    every = [*ended, *live]
    every.sort(key=lambda b: b[1] / (len(prompt) + len(b[0])) ** length_penalty, reverse=True)
    return every[:width]


def test_the_beams_are_those_of_the_search_written_out(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    served_before = cluster.service.counters.actual_cached_tokens
    answer = client.completions.create(
        model=MODEL,
        prompt="The three primary colours are",
        max_tokens=4,
        n=3,
        extra_body=BEAMS | {"ignore_eos": True, "length_penalty": 0.5},
    )
    prompt = answer.choices[0].model_extra["prompt_token_ids"]  # type: ignore[index]
    expected = searched(cluster, prompt, 3, 4, length_penalty=0.5)
    got = [tuple(choice.model_extra["token_ids"]) for choice in answer.choices]  # type: ignore[index]
    assert got == [tokens for tokens, _ in expected]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in answer.choices)
    texts = [
        httpx.post(
            f"{cluster.http_url}/detokenize", json={"model": MODEL, "tokens": list(t)}
        ).json()["prompt"]
        for t in got
    ]
    assert [c.text for c in answer.choices] == texts
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == 3 * 4
    # every step after the first reads the prompt and the beam so far from the cache
    assert cluster.service.counters.actual_cached_tokens - served_before >= 3 * len(prompt)
    assert_no_leak(cluster)


def test_one_beam_is_greedy_decoding(client: openai.OpenAI, cluster: LocalCluster) -> None:
    asked: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6}
    greedy = client.completions.create(
        **asked, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    beam = client.completions.create(**asked, extra_body=BEAMS | {"ignore_eos": True})
    assert beam.choices[0].model_extra["token_ids"] == greedy.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert beam.choices[0].text == greedy.choices[0].text


def test_several_prompts_and_the_end_of_sequence(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """Each prompt's beams in its own choices (p x n + i), an end-of-sequence token ending a
    beam as the search written out ends it (whether the tiny model ranks one high or not)."""
    info = httpx.get(f"{cluster.http_url}/tokenizer_info", timeout=30).json()
    eos_text = info["eos_token"]
    eos = frozenset(
        httpx.post(
            f"{cluster.http_url}/tokenize", json={"model": MODEL, "prompt": eos_text}
        ).json()["tokens"]
    )
    prompts = ["A list of fruit:", "Numbers: 1, 2,"]
    answer = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, n=2, extra_body=BEAMS
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    for p, text in enumerate(prompts):
        ids = httpx.post(
            f"{cluster.http_url}/tokenize", json={"model": MODEL, "prompt": text}
        ).json()["tokens"]
        expected = [tokens for tokens, _ in searched(cluster, ids, 2, 3, eos)]
        got = [tuple(c.model_extra["token_ids"]) for c in answer.choices[2 * p : 2 * p + 2]]  # type: ignore[index]
        assert got == expected


def test_a_search_is_metered_as_one_call_a_prompt(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """Its steps are routed but not metered: the tenant's usage, the calls by status and the
    latencies hold the two prompts' calls, their prompts' tokens and their beams' tokens, not
    the dozen steps that served them."""
    service = cluster.service
    ok, timed, routed = service.counters.by_status.get("OK", 0), ended(service), routed_now(cluster)
    answer = client.completions.create(
        model=MODEL,
        prompt=["The sky is", "Water is"],
        max_tokens=3,
        n=2,
        extra_body=BEAMS | {"ignore_eos": True},
        extra_headers={"X-Radixmesh-Tenant": "beams"},
    )
    assert answer.usage is not None
    usage = service.tenants.tenants["beams"]
    assert usage.requests == 2
    assert usage.prompt_tokens == answer.usage.prompt_tokens
    assert usage.generated_tokens == answer.usage.completion_tokens == 2 * 2 * 3
    assert service.counters.by_status.get("OK", 0) == ok + 2
    assert ended(service) == timed + 2
    assert routed_now(cluster) >= routed + 2 * 3  # each prompt's steps: one a beam a token
    assert_no_leak(cluster)


def test_streamed_beams_are_the_whole_answers(client: openai.OpenAI, cluster: LocalCluster) -> None:
    """As vLLM streams a beam search: each choice in a chunk of its own once the beams are
    found (its whole text, ids and logprobs), then the usage; the same beams as unstreamed."""
    asked: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "n": 2, "extra_body": BEAMS}
    prompts = ["The sky is", "Water is"]
    whole = client.completions.create(prompt=prompts, logprobs=2, **asked)
    chunks = list(
        client.completions.create(
            prompt=prompts, logprobs=2, stream=True, stream_options={"include_usage": True}, **asked
        )
    )
    streamed = {c.choices[0].index: c.choices[0] for c in chunks if c.choices}
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in whole.choices:
        got = streamed[choice.index]
        assert (got.text, got.finish_reason) == (choice.text, choice.finish_reason)
        assert got.model_extra["token_ids"] == choice.model_extra["token_ids"]  # type: ignore[index]
        assert got.logprobs is not None and choice.logprobs is not None
        assert got.logprobs.tokens == choice.logprobs.tokens
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], **asked}
    answer = client.chat.completions.create(**chat)
    texts: dict[int, str] = {}
    ends: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(**chat, stream=True):
        for delta in chunk.choices:
            texts[delta.index] = texts.get(delta.index, "") + (delta.delta.content or "")
            ends[delta.index] = delta.finish_reason or ends.get(delta.index)
    assert texts == {c.index: c.message.content for c in answer.choices}
    assert ends == {c.index: c.finish_reason for c in answer.choices}
    assert_no_leak(cluster)


def test_a_failed_search_is_counted_once_under_its_status(
    client: openai.OpenAI, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many of its steps fail together: a step refused for load (five beams past
    three calls in flight) is the call's 429, counted once; so is a max_tokens the context
    cannot hold, found after the first step, as the same refusal without beam search is."""
    service = cluster.service
    limits = service.request_limits()
    assert limits is not None
    asked: dict[str, Any] = {"model": MODEL, "prompt": "The sky is", "extra_body": BEAMS}
    before = dict(service.counters.by_status)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(max_tokens=limits.max_model_len - 2, n=2, **asked)
    assert gained(cluster, before) == {"INVALID_ARGUMENT": 1}
    monkeypatch.setattr(service, "config", replace(service.config, max_in_flight=3))
    before = dict(service.counters.by_status)
    with pytest.raises(openai.RateLimitError):
        client.with_options(max_retries=0).completions.create(max_tokens=4, n=5, **asked)
    assert gained(cluster, before) == {"RESOURCE_EXHAUSTED": 1}
    assert_no_leak(cluster)


def test_a_draining_router_finishes_the_searches_it_took(
    client: openai.OpenAI, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its later steps are served, and the search is a call the drain waits for throughout
    (`busy`), between two steps too, when no step is in flight; a search asked for once
    draining is refused."""
    assert cluster.http is not None
    api, service = cluster.http.api, cluster.service
    steps: list[tuple[int, bool]] = []  # as each step starts: the calls in flight, busy
    generate = service.generate

    def step(*args: Any, **kwargs: Any) -> Any:
        steps.append((len(service.in_flight), service.busy()))
        if len(steps) == 3:
            api.draining = True  # RouterActor.drain, once the search is under way
        return generate(*args, **kwargs)

    monkeypatch.setattr(service, "generate", step)
    monkeypatch.setattr(api, "draining", False)
    asked: dict[str, Any] = {"model": MODEL, "prompt": "The sky is", "extra_body": BEAMS}
    answer = client.completions.create(
        max_tokens=6, n=2, **asked | {"extra_body": BEAMS | {"ignore_eos": True}}
    )
    assert api.draining and len(answer.choices) == 2
    assert len(steps) == 1 + 5 * 2  # the first, then two beams a step
    assert all(busy for _, busy in steps)
    assert (0, True) in steps[1:]  # between two steps: nothing in flight, and still busy
    assert not service.busy()
    with pytest.raises(openai.InternalServerError, match="draining"):
        client.with_options(max_retries=0).completions.create(max_tokens=2, n=2, **asked)
    assert_no_leak(cluster)


def gained(cluster: LocalCluster, before: dict[str, int]) -> dict[str, int]:
    """What each status's count gained since `before`."""
    now = cluster.service.counters.by_status
    return {k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)}


def routed_now(cluster: LocalCluster) -> int:
    return cluster.service.counters.routed


def test_chat_beams_with_their_logprobs(client: openai.OpenAI, cluster: LocalCluster) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a planet."}],
        max_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body=BEAMS | {"ignore_eos": True},
    )
    prompt = answer.model_extra["prompt_token_ids"]  # type: ignore[index]
    best = searched(cluster, prompt, 2, 3)
    assert [tuple(c.model_extra["token_ids"]) for c in answer.choices] == [t for t, _ in best]  # type: ignore[index]
    for choice, (_, total) in zip(answer.choices, best, strict=True):
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 3
        assert all(len(each.top_logprobs) == 2 for each in choice.logprobs.content)
        assert sum(each.logprob for each in choice.logprobs.content) == pytest.approx(
            total, abs=1e-4
        )


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"stop": ["."]}, "stop"),
        ({"n": MAX_WIDTH + 1}, "n"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 0}, "n"),
        ({"length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_what_beam_search_does_not_do_is_refused_by_name(
    cluster: LocalCluster, extra: dict[str, Any], field: str
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "use_beam_search": True, **extra}
    raw = json.dumps(body)  # NaN written as JavaScript writes it, which the server parses
    answer = httpx.post(
        f"{cluster.http_url}/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"].startswith(field), answer.text
    assert_no_leak(cluster)


def test_a_long_request_id_over_several_prompts_and_more_alternatives_than_candidates(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """Each prompt's steps keep ids of their own however long the client's X-Request-Id (the
    router cuts it to fit 128 characters); `top_logprobs` past 2 x n still gets that many."""
    answer = client.completions.create(
        model=MODEL,
        prompt=["First prompt", "Second prompt"],
        max_tokens=2,
        n=2,
        extra_body={"use_beam_search": True, "ignore_eos": True},
        extra_headers={"X-Request-Id": "r" * 124},  # its prompts: 126 characters
    )
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello."}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=5,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and all(len(each.top_logprobs) == 5 for each in content)
    assert_no_leak(cluster)


def test_a_thinking_models_reasoning_apart_is_refused(thinking_cluster: LocalCluster) -> None:
    """Beams are searched over the whole text: a thinking model's reasoning would land in its
    content, so asking for it apart (the chat default) is refused by name; whole, it is served."""
    url = f"{thinking_cluster.http_url}/v1/chat/completions"
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Think."}],
        "max_tokens": 2,
        "use_beam_search": True,
    }
    refused = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 400 and "use_beam_search" in refused.text
    whole = httpx.post(url, json=body | {"separate_reasoning": False}, timeout=60)
    assert whole.status_code == 200, whole.text
    assert_no_leak(thinking_cluster)
