"""The OpenAI API on the router, driven by the official `openai` SDK over real HTTP on loopback,
against a local cluster of two tiny-model workers: what the SDK gets is what vLLM's users get."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace

import httpx2 as httpx
import openai
import pytest

from cluster.client import Client, text_request
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MODEL = SERVED_NAME
PROMPT = "the quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    cluster = start_cluster(tiny, http=True)
    yield cluster
    cluster.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def assert_no_leak(cluster: LocalCluster, within_s: float = 20) -> None:
    """Every request ended on every worker and every page is back (free or cached)."""
    cluster.wait_idle(within_s)
    assert not cluster.service.in_flight


def test_chat_completion_has_openai_shape_and_cached_tokens(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert first.object == "chat.completion" and first.model == MODEL
    assert first.id.startswith("chatcmpl-")
    (choice,) = first.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = first.usage
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == choice.message.content  # greedy
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt hit the cache
    assert_no_leak(cluster)


def grpc_tokens(cluster: LocalCluster, **prompt: object) -> list[int]:
    """What the gRPC face generates for the same greedy request."""
    request = text_request(**prompt, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    return [t for r in Client(cluster.target).generate(request, timeout=30) for t in r.token_ids]


def chat_ids(cluster: LocalCluster) -> list[int]:
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    return tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)


def test_completions_text_and_token_ids_match_grpc(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.usage is not None and text.usage.completion_tokens == 8
    assert text.choices[0].finish_reason == "length"
    ids = cluster.links.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    assert text.choices[0].text == tokenizer.decode(grpc_tokens(cluster, text=PROMPT))
    assert_no_leak(cluster)


def test_chat_stream_matches_the_whole_answer_and_reports_usage(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, usage_chunk = chunks
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in content]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]
    assert all(c.usage is None for c in content)
    assert_no_leak(cluster)


def test_raw_stream_is_server_sent_events_ending_in_done(cluster: LocalCluster) -> None:
    # ignore_eos: sampled at temperature 1, the tiny model sometimes ends with EOS (a CI run did)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last


def test_async_client_serves_concurrent_requests(cluster: LocalCluster) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0
        ) as client:
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"{PROMPT} {i % 2}"}],
                        max_tokens=6,
                        temperature=0,
                    )
                    for i in range(6)
                )
            )
        return [a.choices[0].message.content or "" for a in answers]

    texts = asyncio.run(main())
    assert texts[0::2] == [texts[0]] * 3 and texts[1::2] == [texts[1]] * 3
    assert_no_leak(cluster)


def test_n_samples_are_indexed_and_reproducible_by_seed(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    def ask(seed: int) -> list[str]:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=10,
            n=3,
            seed=seed,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in answer.choices] == [0, 1, 2]
        assert answer.usage is not None  # every sample counts, the prompt once
        assert answer.usage.completion_tokens == 3 * 10
        assert answer.usage.prompt_tokens == len(chat_ids(cluster))
        return [c.message.content or "" for c in answer.choices]

    first = ask(7)
    assert ask(7) == first
    assert len(set(first)) > 1  # three draws, not one
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=10,
        n=3,
        seed=7,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == first
    assert_no_leak(cluster)


def test_stop_strings_cut_the_text(client: openai.OpenAI, cluster: LocalCluster) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = whole.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert_no_leak(cluster)


def test_penalties_are_accepted_and_change_a_greedy_answer(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    def ask(**penalties: float) -> str:
        answer = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
            **penalties,  # type: ignore[arg-type]
        )
        return answer.choices[0].text

    plain = ask()
    assert ask(presence_penalty=0.0) == plain
    changed = [
        ask(presence_penalty=2.0) != plain,
        ask(frequency_penalty=2.0) != plain,
    ]
    repetition = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"repetition_penalty": 2.0, "ignore_eos": True},
    )
    changed.append(repetition.choices[0].text != plain)
    assert all(changed), changed
    assert_no_leak(cluster)


def test_client_disconnect_mid_stream_frees_pages_within_a_second(
    cluster: LocalCluster,
) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert cluster.service.in_flight
    left = time.monotonic()
    cluster.wait_idle(timeout=1.0)
    while cluster.service.in_flight and time.monotonic() - left < 1.0:
        time.sleep(0.01)
    assert not cluster.service.in_flight, "the request outlived its client by a second"
    assert_no_leak(cluster)


def test_models_health_tokenize_detokenize(cluster: LocalCluster) -> None:
    url = cluster.http_url
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == cluster.config.engine.max_model_len
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    assert sdk.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    assert httpx.get(f"{url}/v1/models/{MODEL}").json() == models["data"][0]
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("org/no-such-model")  # a slash in an id, as hub names have
    error = missing.value.response.json()["error"]
    assert error["param"] == "model" and "'org/no-such-model' does not exist" in error["message"]
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["workers"] == 2
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == cluster.links.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    assert tokens["count"] == len(tokens["tokens"])
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()
    usage = (
        openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        .chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
        .usage
    )
    assert usage is not None and chat["count"] == usage.prompt_tokens
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == cluster.links.tokenizer.decode(tokens["tokens"])  # type: ignore[union-attr]
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]


def test_logprobs_of_chat_and_completions(client: openai.OpenAI, cluster: LocalCluster) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert plain.choices[0].logprobs is None
    ask = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        logprobs=True,
        top_logprobs=3,
        **ask,  # type: ignore[arg-type]
    )
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 6
    for entry in logprobs.content:
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert entry.token == top[0].token  # greedy: the chosen token is the most likely
        assert entry.logprob == pytest.approx(top[0].logprob) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in logprobs.content) == chat.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        **ask,  # type: ignore[arg-type]
    ):
        for choice in chunk.choices:
            streamed += (
                choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            )
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in logprobs.content
    ]
    text = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, **ask)  # type: ignore[arg-type]
    got = text.choices[0].logprobs
    assert got is not None and got.tokens is not None and got.token_logprobs is not None
    assert len(got.tokens) == len(got.token_logprobs) == 6
    assert got.top_logprobs is not None and all(1 <= len(t) <= 2 for t in got.top_logprobs)
    assert got.text_offset == sorted(got.text_offset) and got.text_offset[0] == 0
    assert "".join(got.tokens) == text.choices[0].text
    assert_no_leak(cluster)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(cluster: LocalCluster) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 5,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line and line != "data: [DONE]"]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1]["choices"] == []
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)


def test_responses_name_the_worker_and_the_routers_prediction(cluster: LocalCluster) -> None:
    body = {"model": MODEL, "prompt": PROMPT + " again", "max_tokens": 2}
    first = httpx.post(f"{cluster.http_url}/v1/completions", json=body)
    worker = first.headers["x-radixmesh-worker"]
    assert worker in cluster.engines
    with httpx.stream(
        "POST", f"{cluster.http_url}/v1/completions", json={**body, "stream": True}
    ) as second:
        assert second.headers["x-radixmesh-worker"] == worker  # the cache-aware route
        predicted = int(second.headers["x-radixmesh-predicted-cached-tokens"])
        last = [line for line in second.iter_lines() if line.startswith("data: {")][-1]
    assert predicted > 0 and json.loads(last.removeprefix("data: "))["choices"]


def test_a_pool_smaller_than_the_context_cuts_it_and_a_default_request_is_served(
    tiny: LoadedModel,
) -> None:
    """The tiny model's context is 1,024 positions; 15 usable pages of 4 hold 60. A request
    with no max_tokens (OpenAI's default: to the end of the context) was refused for pages its
    client never asked for; now the context the API reports is what the pool holds, and the
    request fills it."""
    engine = replace(ENGINE, num_pages=16, page_size=4, max_model_len=None)
    small = start_cluster(tiny, workers=1, engine=engine, http=True)
    try:
        sdk = openai.OpenAI(base_url=f"{small.http_url}/v1", api_key="none", max_retries=0)
        (card,) = sdk.models.list().data
        assert card.model_extra is not None and card.model_extra["max_model_len"] == 60
        answer = sdk.chat.completions.create(model=MODEL, messages=CHAT, temperature=0)
        usage = answer.usage
        assert usage is not None and usage.prompt_tokens + usage.completion_tokens <= 60
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert_no_leak(small)
    finally:
        small.close()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": None}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": None}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "prompt_cache_retention": "in_memory"}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2,
                           "prompt_cache_retention": "in_memory"}),
    ],
)  # fmt: skip
def test_what_the_sdk_sends_for_nothing_is_accepted(
    cluster: LocalCluster, path: str, body: dict[str, object]
) -> None:
    """OpenAI's nullable booleans sent as null (clients that write unset fields so), and the
    cache retention as the SDK spells it (`in_memory`; the API reference's `in-memory`)."""
    reply = httpx.post(f"{cluster.http_url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
