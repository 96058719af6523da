"""What happens to an HTTP request between its arrival and its end: a client that leaves while
its request waits for a first token, a worker that dies mid-stream (the stream goes on exactly,
penalties and logprobs included), and the OpenAI defaults and ranges that real clients rely on."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from cluster.config import EngineSection, RouterSection
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MODEL = SERVED_NAME
PROMPT = "the quick brown fox jumps over the lazy dog"


def wait_until(predicate: Any, what: str, timeout: float = 10) -> float:
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, what
        time.sleep(0.005)
    return time.monotonic() - began


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: "))
        for line in response.iter_lines()
        if line.startswith("data: {")
    ]


@pytest.fixture(scope="module")
def one_slot(tiny: LoadedModel) -> Iterator[LocalCluster]:
    """One worker running one sequence at a time: a second request waits for its first token."""
    engine = EngineSection(**{**vars(ENGINE), "max_running": 1})
    cluster = start_cluster(tiny, workers=1, engine=engine, http=True)
    yield cluster
    cluster.close()


def raw_post(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A request sent on a socket of our own, so the test can hang up at any moment."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_its_first_token_frees_its_place(
    one_slot: LocalCluster, stream: bool
) -> None:
    url = one_slot.http_url
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True}) as busy:
        lines = busy.iter_lines()
        next(lines)  # the slot is taken
        waiting = {"model": MODEL, "prompt": "another prompt", "max_tokens": 5, "stream": stream}
        sock = raw_post(one_slot.http.port, "/v1/completions", waiting)  # type: ignore[union-attr]
        engine = next(iter(one_slot.engines.values()))
        wait_until(  # it reached the worker's queue: no first token yet
            lambda: len(one_slot.service.in_flight) == 2 and engine.stats().waiting == 1,
            "the second request waits on the worker",
        )
        sock.close()
        wait_until(  # the router lets it go first, then the worker's queue: both within a second
            lambda: len(one_slot.service.in_flight) == 1 and engine.stats().waiting == 0,
            "it left the router and the worker's queue",
            timeout=1.0,
        )
        assert engine.stats().running == 1  # the first request is untouched
    one_slot.wait_idle()
    assert not one_slot.service.in_flight


def test_a_worker_dying_mid_stream_is_invisible_over_http(tiny: LoadedModel) -> None:
    """n = 2 seeded samples with every penalty and logprobs: the migrated stream is the
    undisturbed one, token text and logprobs alike."""
    cluster = start_cluster(tiny, workers=2, http=True, router=RouterSection(port=0))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 300,
        "n": 2,
        "seed": 11,
        "temperature": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.2,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{cluster.http_url}/v1/chat/completions"
    try:
        with httpx.stream("POST", url, json=body) as undisturbed:
            expected = choices(sse(undisturbed))
        chunks: list[dict[str, Any]] = []
        with httpx.stream("POST", url, json=body, timeout=60) as cut:
            worker = cut.headers["x-radixmesh-worker"]
            events = (json.loads(line[6:]) for line in cut.iter_lines() if line[6:7] == "{")
            chunks += [next(events) for _ in range(6)]
            killer = threading.Thread(target=cluster.kill_worker, args=(worker,))
            killer.start()
            chunks += list(events)
            killer.join()
        assert cluster.service.counters.migrated >= 1, "the stream ended before the kill"
        got = choices(chunks)
        for index in (0, 1):
            assert got[index]["text"] == expected[index]["text"]
            assert [t for t, _ in got[index]["logprobs"]] == [
                t for t, _ in expected[index]["logprobs"]
            ]
            assert [lp for _, lp in got[index]["logprobs"]] == pytest.approx(
                [lp for _, lp in expected[index]["logprobs"]], abs=1e-4
            )
        cluster.wait_idle()
        assert not cluster.service.in_flight
    finally:
        cluster.close()


def choices(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            each = out.setdefault(choice["index"], {"text": "", "logprobs": []})
            each["text"] += choice["delta"].get("content") or ""
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                each["logprobs"].append((entry["token"], entry["logprob"]))
            each["finish"] = choice["finish_reason"] or each.get("finish")
    return out


def test_a_request_id_sent_again_after_its_client_left_is_served(
    one_slot: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gives up on a stream and sends the request again under its X-Request-Id once
    the router has let the id go: the worker, still ending the first call until its engine's
    next step (50 ms here, a loaded GPU's), serves the second under an id of its own."""
    for engine in one_slot.engines.values():

        def step(original: Any = engine.step) -> bool:
            busy = original()
            if busy:
                time.sleep(0.05)
            return busy

        monkeypatch.setattr(engine, "step", step)
    url = f"{one_slot.http_url}/v1/completions"
    body = {"model": MODEL, "prompt": "the same prompt", "max_tokens": 400, "ignore_eos": True}
    headers = {"x-request-id": "again"}
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers) as first:
        next(first.iter_lines())  # its first token; then the client leaves
    deadline = time.monotonic() + 5
    while one_slot.service.in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    again = httpx.post(url, json={**body, "max_tokens": 2}, headers=headers, timeout=30)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == "cmpl-again"
    one_slot.wait_idle()


def test_a_call_is_busy_from_before_its_prompt_is_tokenised(
    one_slot: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a drain waits for (`RouterService.busy`): a call the router took and is still
    tokenising, before it has the call in flight."""
    service = one_slot.service
    entered, release = threading.Event(), threading.Event()
    prepare = service._prepare

    async def tokenising(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await asyncio.to_thread(release.wait, 10)
        return await prepare(*args, **kwargs)

    monkeypatch.setattr(service, "_prepare", tokenising)
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 2}
    answers: list[httpx.Response] = []
    url = f"{one_slot.http_url}/v1/completions"
    caller = threading.Thread(target=lambda: answers.append(httpx.post(url, json=body, timeout=30)))
    caller.start()
    try:
        assert entered.wait(10)
        assert not service.in_flight and service.busy()
    finally:
        release.set()
        caller.join()
    assert answers[0].status_code == 200, answers[0].text
    assert not service.busy()


def test_openai_defaults_nulls_and_seeds(one_slot: LocalCluster) -> None:
    url = one_slot.http_url
    legacy = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "ignore_eos": True}
    ).json()
    assert legacy["usage"]["completion_tokens"] == 16  # OpenAI's default for completions
    nulls = {"logprobs": None, "stream": None, "top_logprobs": None, "max_tokens": 3}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **nulls}
    answer = httpx.post(f"{url}/v1/chat/completions", json=chat)
    assert answer.status_code == 200 and answer.json()["choices"][0]["logprobs"] is None
    seeded = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "seed": -1, "temperature": 1}
    texts = [
        httpx.post(f"{url}/v1/completions", json=seeded).json()["choices"][0]["text"]
        for _ in range(2)
    ]
    assert texts[0] == texts[1]


def test_text_offsets_agree_streamed_or_not_and_stay_inside_the_text(
    one_slot: LocalCluster,
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    url = f"{one_slot.http_url}/v1/completions"
    whole = httpx.post(url, json=body).json()["choices"][0]
    with httpx.stream("POST", url, json={**body, "stream": True}) as response:
        streamed = [
            offset
            for chunk in sse(response)
            for choice in chunk["choices"]
            for offset in (choice["logprobs"] or {}).get("text_offset", [])
        ]
    offsets = whole["logprobs"]["text_offset"]
    assert offsets == streamed and len(offsets) == 24
    assert offsets == sorted(offsets) and all(0 <= o <= len(whole["text"]) for o in offsets)


def test_oversized_headers_and_tenants_are_refused(one_slot: LocalCluster) -> None:
    url = one_slot.http_url
    huge = httpx.get(f"{url}/health", headers={"x-filler": "a" * (64 << 10)})
    assert huge.status_code == 431 and "headers" in huge.json()["error"]["message"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    tenant = httpx.post(
        f"{url}/v1/completions", json=body, headers={"x-radixmesh-tenant": "t" * 300}
    )
    assert tenant.status_code == 400 and tenant.json()["error"]["param"] == "namespace.tenant"
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


def test_the_worker_takes_the_prompts_block_hashes_from_the_router(one_slot: LocalCluster) -> None:
    """The router hashed the prompt to route it; the worker's cache uses that chain instead of
    hashing the prompt again, and stores and publishes exactly those blocks."""
    engine = next(iter(one_slot.engines.values()))
    before = engine.cache.stats.given_blocks
    prompt = " ".join([PROMPT] * 8)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    answer = httpx.post(f"{one_slot.http_url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    one_slot.wait_idle()
    taken = engine.cache.stats.given_blocks - before
    tokens = answer.json()["usage"]["prompt_tokens"]
    assert taken == tokens // engine.cache.hasher.block_size > 0
