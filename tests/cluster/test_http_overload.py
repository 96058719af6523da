"""Backpressure and absence over HTTP: 429 past `router.max_in_flight`, 503 with no worker (and
while draining), each with Retry-After, in OpenAI's and Anthropic's error shapes; the server
serves again once the load is gone or a worker is attached."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import anthropic
import httpx2 as httpx
import openai
import pytest

from cluster.config import RouterSection
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MODEL = SERVED_NAME
CHAT = [{"role": "user", "content": "hi"}]


def clients(cluster: LocalCluster) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    url = cluster.http_url
    return (
        openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0),
        anthropic.Anthropic(base_url=url, api_key="none", max_retries=0),
    )


def assert_refused(err: openai.APIStatusError, status: int, kind: str) -> None:
    assert err.status_code == status
    assert err.response.headers["retry-after"] == "1"
    assert err.response.json()["error"]["type"] == kind


def assert_refused_anthropic(err: anthropic.APIStatusError, status: int, kind: str) -> None:
    assert err.status_code == status
    assert err.response.headers["retry-after"] == "1"
    body = err.response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]


def test_past_max_in_flight_is_429_with_retry_after(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = replace(ENGINE, num_pages=1024, max_model_len=1024)
    router = RouterSection(port=0, max_in_flight=2)
    cluster = start_cluster(tiny, http=True, router=router, engine=engine)
    oa, an = clients(cluster)
    release = cluster.hold_engines_after(20, monkeypatch)  # the two streams cannot end early
    try:
        with contextlib.ExitStack() as held:  # two long streams, left unread, fill the limit
            for i in range(2):
                body = {
                    "model": MODEL,
                    "prompt": f"{i} the long stream",
                    "max_tokens": 1000,
                    "ignore_eos": True,
                    "stream": True,
                }
                url = f"{cluster.http_url}/v1/completions"
                response = held.enter_context(httpx.stream("POST", url, json=body))
                assert response.status_code == 200
            assert len(cluster.service.in_flight) == 2
            with pytest.raises(openai.RateLimitError) as err:
                oa.completions.create(model=MODEL, prompt="one more", max_tokens=2)
            assert_refused(err.value, 429, "rate_limit_error")
            assert "the limit is 2" in err.value.message
            with pytest.raises(openai.RateLimitError) as err:  # a status, not an error event
                oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True)
            assert_refused(err.value, 429, "rate_limit_error")
            with pytest.raises(anthropic.RateLimitError) as aerr:
                an.messages.create(model=MODEL, max_tokens=2, messages=CHAT)  # type: ignore[list-item]
            assert_refused_anthropic(aerr.value, 429, "rate_limit_error")
            assert httpx.get(f"{cluster.http_url}/health").status_code == 200
            assert len(cluster.service.in_flight) == 2  # still held: the limit refused them
        release.set()
        cluster.wait_idle()
        assert not cluster.service.in_flight
        answer = oa.completions.create(model=MODEL, prompt="one more", max_tokens=2)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert cluster.service.counters.http_responses[("/v1/completions", 429)] == 1
    finally:
        release.set()
        oa.close()
        an.close()
        cluster.close()


def test_no_worker_is_503_until_one_is_attached(tiny: LoadedModel) -> None:
    cluster = start_cluster(tiny, workers=0, http=True)
    oa, an = clients(cluster)
    url = cluster.http_url
    try:
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json() == {"status": "no healthy worker", "workers": 0}
        with pytest.raises(openai.APIStatusError) as err:
            oa.completions.create(model=MODEL, prompt="anyone?", max_tokens=2)
        assert_refused(err.value, 503, "service_unavailable_error")
        assert "no healthy worker" in err.value.message
        with pytest.raises(openai.APIStatusError) as err:
            oa.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True)
        assert_refused(err.value, 503, "service_unavailable_error")
        with pytest.raises(anthropic.APIStatusError) as aerr:
            an.messages.create(model=MODEL, max_tokens=2, messages=CHAT)  # type: ignore[list-item]
        assert_refused_anthropic(aerr.value, 503, "overloaded_error")
        tokenize = httpx.post(f"{url}/tokenize", json={"prompt": "x"})
        assert tokenize.status_code == 503 and tokenize.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] is None

        cluster.add_worker("worker-0")
        health = httpx.get(f"{url}/health")
        assert health.status_code == 200 and health.json() == {"status": "ok", "workers": 1}
        answer = oa.completions.create(model=MODEL, prompt="anyone?", max_tokens=2)
        assert answer.usage is not None and answer.usage.completion_tokens >= 1
        assert an.messages.create(model=MODEL, max_tokens=2, messages=CHAT).content  # type: ignore[list-item]

        assert cluster.http is not None
        cluster.http.api.draining = True  # what the router sets when it drains
        assert httpx.get(f"{url}/health").json()["status"] == "draining"
        with pytest.raises(openai.APIStatusError) as err:
            oa.completions.create(model=MODEL, prompt="anyone?", max_tokens=2)
        assert_refused(err.value, 503, "service_unavailable_error")
        cluster.http.api.draining = False
        assert httpx.get(f"{url}/health").status_code == 200
        cluster.wait_idle()
    finally:
        oa.close()
        an.close()
        cluster.close()
