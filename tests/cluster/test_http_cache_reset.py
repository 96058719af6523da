"""vLLM's `POST /reset_prefix_cache` and SGLang's `/flush_cache` on a real cluster: what was
cached is computed again after one, an operator's token is needed, and a worker with a request
running refuses (409) and leaves its cache, serving on."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest

from cluster.config import SecuritySection
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

TOKENS = {"t-admin": "*", "t-acme": "acme"}
ADMIN = {"authorization": "Bearer t-admin"}
PROMPT = "The cache keeps what every worker computed once, " * 4


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny, http=True, security=SecuritySection(auth_tokens=TOKENS))
    yield running
    running.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    url = f"{cluster.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="t-admin", max_retries=0) as c:
        yield c


def cached(client: openai.OpenAI) -> int:
    answer = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=2)
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/reset_prefix_cache"), ("POST", "/flush_cache"), ("GET", "/flush_cache")],
)
def test_a_reset_empties_every_cache(
    cluster: LocalCluster, client: openai.OpenAI, method: str, path: str
) -> None:
    cached(client)
    assert cached(client) > 0
    cluster.wait_idle()
    reset = httpx.request(method, cluster.http_url + path, headers=ADMIN, timeout=30)
    assert reset.status_code == 200 and reset.json()["pages_freed"] > 0
    assert cached(client) == 0
    again = httpx.request(method, cluster.http_url + path, headers=ADMIN, timeout=30)
    assert again.status_code == 200 and again.json()["pages_freed"] > 0  # the last prompt's


def test_a_reset_needs_an_operators_token(cluster: LocalCluster, client: openai.OpenAI) -> None:
    cached(client)
    cluster.wait_idle()
    for headers, status in (({}, 401), ({"authorization": "Bearer t-acme"}, 403)):
        refused = httpx.post(cluster.http_url + "/reset_prefix_cache", headers=headers)
        assert refused.status_code == status
    assert "tenant '*'" in refused.json()["error"]["message"]
    assert cached(client) > 0  # nothing was cleared


def test_a_worker_with_a_request_running_refuses_and_serves_on(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engines are held mid-stream; the reset is asked for meanwhile and reaches each
    engine when it steps again, with the request still running."""
    release = cluster.hold_engines_after(4, monkeypatch)
    body = {"model": SERVED_NAME, "prompt": "held", "max_tokens": 64, "ignore_eos": True}
    url = cluster.http_url + "/v1/completions"
    flush = functools.partial(httpx.post, cluster.http_url + "/flush_cache", headers=ADMIN)
    try:
        with (
            httpx.stream("POST", url, json={**body, "stream": True}, headers=ADMIN) as held,
            ThreadPoolExecutor(1) as pool,
        ):
            lines = held.iter_lines()
            assert next(lines).startswith("data: ")  # running, and held
            asked = pool.submit(flush, timeout=30)
            (busy,) = [e for e in cluster.engines.values() if e._requests]
            deadline = time.monotonic() + 10
            while busy._inbox.empty() and not asked.done():  # held, or taken at once
                assert time.monotonic() < deadline, "the reset never reached the engines"
                time.sleep(0.01)  # until it waits in the busy engine's inbox
            release.set()
            refused = asked.result(timeout=30)
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert error["type"] == "conflict_error"
            assert error["message"].startswith("worker worker-")
            assert error["message"].endswith("requests are running; clear when idle")
            assert [line for line in lines if line][-1] == "data: [DONE]"  # served on
    finally:
        release.set()
    cluster.wait_idle()
    assert flush(timeout=30).status_code == 200  # idle now
