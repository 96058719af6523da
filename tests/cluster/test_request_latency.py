"""The router's latency histograms (cluster/request_latency.py) on a local cluster of two
tiny-model workers, read as Prometheus scrapes them: each call the `openai` SDK makes is timed
once, no later than its client saw it; the token and cache histograms agree with the usage the
client was given; a refused call is not timed; and a call moved off a worker killed under it is
still one call, timed from its start."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from cluster.client import Client, text_request
from cluster.loadtest.server_metrics import Buckets
from cluster.router_metrics import RouterCollector
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.test_migration import finish, request, stream, wait_until
from tests.cluster.tool_fixtures import served
from tests.prometheus_text import at_most, histograms
from worker.loader import LoadedModel

R = "radixmesh_router_"
FIRST, GAP = f"{R}time_to_first_token_seconds", f"{R}inter_token_latency_seconds"
E2E, EMBED = f"{R}e2e_request_latency_seconds", f"{R}embedding_latency_seconds"
PROMPT, CACHED = f"{R}request_prompt_tokens", f"{R}request_cached_prompt_ratio"
GENERATED = f"{R}request_generation_tokens"


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def scrape(cluster: LocalCluster) -> dict[str, Buckets]:
    return histograms(RouterCollector(cluster.service))


def since(before: dict[str, Buckets], cluster: LocalCluster) -> dict[str, Buckets]:
    return {name: h.minus(before[name]) for name, h in scrape(cluster).items()}


def test_streamed_calls_are_timed_once_and_no_later_than_their_client_saw_them(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    before = scrape(cluster)
    seen_first, usages = [], []
    for i in range(6):
        began = time.perf_counter()
        first = None
        chunks = client.completions.create(
            model=SERVED_NAME,
            prompt=[*range(20, 60), i],  # one shared head: the later calls hit the cache
            max_tokens=5 + i,
            temperature=0.8,
            seed=i,
            n=1 + i % 2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            if first is None and any(c.text for c in chunk.choices):
                first = time.perf_counter() - began
            if chunk.usage is not None:
                usages.append(chunk.usage)
        assert first is not None
        seen_first.append(first)
    got = since(before, cluster)
    assert got[FIRST].count == got[E2E].count == len(seen_first) == 6
    # every call's time to first token, as the router took it, is no later than its client's
    # first text: at every bucket bound, at least as many router figures lie below
    for bound in got[FIRST].cumulative:
        assert at_most(got[FIRST], bound) >= sum(f <= bound for f in seen_first), bound
    assert got[E2E].sum >= got[FIRST].sum
    # one gap per token after each sample's first (nothing drafted: no speculative decoding)
    samples = sum(1 + i % 2 for i in range(6))
    assert got[GAP].count == sum(u.completion_tokens for u in usages) - samples
    assert got[GENERATED].sum == sum(u.completion_tokens for u in usages)
    assert got[PROMPT].sum == sum(u.prompt_tokens for u in usages) == 6 * 41
    cached = [u.prompt_tokens_details.cached_tokens / u.prompt_tokens for u in usages]
    assert got[CACHED].sum == pytest.approx(sum(cached))
    assert got[CACHED].count == 6 and at_most(got[CACHED], 0.0) == sum(c == 0 for c in cached)
    assert max(cached) > 0.5  # the shared head was read from a cache
    assert got[EMBED].count == 0
    assert_no_leak(cluster)


def test_embeddings_are_timed_apart_and_refusals_not_at_all(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    before, ok = scrape(cluster), cluster.service.counters.by_status.get("OK", 0)
    client.embeddings.create(model=SERVED_NAME, input=[[5, 6, 7, 8], [9, 10, 11], [12, 13]])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_NAME, prompt=[1, 2, 3], max_tokens=10**6)
    got = since(before, cluster)
    assert got[EMBED].count == 3
    # the SDK's call read each input's stream only to its embedding: each ended well all the same
    assert cluster.service.counters.by_status["OK"] - ok == 3
    assert got[FIRST].count == got[E2E].count == got[GAP].count == 0
    assert got[PROMPT].count == 3 and got[PROMPT].sum == 4 + 3 + 2
    assert got[GENERATED].count == 0
    assert_no_leak(cluster)


def test_a_call_moved_off_a_killed_worker_is_one_call_timed_from_its_start(
    tiny: LoadedModel,
) -> None:
    cluster = start_cluster(tiny, workers=2)
    try:
        before = scrape(cluster)
        client = Client(cluster.target)
        messages = [request(f"Greedy {i}.", max_tokens=40) for i in range(4)]
        streams = [stream(client, m) for m in messages]
        wait_until(lambda: all(len(s.messages) >= 5 for s in streams), "streams started", 60)
        victim = streams[0].messages[-1].worker
        cluster.kill_worker(victim)
        finish(streams)
        assert all(s.error is None for s in streams)
        assert any(s.messages[-1].worker != victim for s in streams)
        got = since(before, cluster)
        assert got[FIRST].count == got[E2E].count == got[CACHED].count == 4
        tokens = [sum(len(m.token_ids) for m in s.messages) for s in streams]
        assert tokens == [40] * 4
        assert got[GAP].count == sum(tokens) - 4
        assert got[GENERATED].sum == sum(tokens)
    finally:
        cluster.close()


def _a_token_spelled_alone_and_twice(tiny: LoadedModel) -> tuple[int, str]:
    """A token whose text spells it alone and twice over (tests/worker/test_bad_words.py)."""
    tokenizer = tiny.tokenizer

    def spelled(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return next(
        (t, p)
        for t in range(3, tiny.config.vocab_size)
        if (p := tokenizer.decode([t])).strip()
        and not p.startswith(" ")
        and spelled(p) == (t,)
        and spelled(p + p) == (t, t)
    )


def test_a_sample_ended_by_an_error_or_an_abort_is_counted_so_and_not_timed_to_its_end(
    cluster: LocalCluster, tiny: LoadedModel
) -> None:
    """gRPC ends such a call with status OK and a last message saying why; the router counts it
    INTERNAL or CANCELLED, times its first token, and never its end."""
    before, statuses = scrape(cluster), dict(cluster.service.counters.by_status)
    client = Client(cluster.target)
    try:
        token, piece = _a_token_spelled_alone_and_twice(tiny)
        failing = text_request("the quick", max_tokens=8)
        failing.sampling.ignore_eos = True
        failing.sampling.allowed_token_ids.append(token)  # after one token, nothing is left
        failing.sampling.bad_words.append(piece + piece)
        last = list(client.generate(failing, timeout=60))[-1]
        assert last.finish_reason == "error"
        aborted = text_request("Abort me after my first token.", max_tokens=400)
        aborted.request_id = "to-abort"
        aborted.sampling.ignore_eos = True
        messages = []
        for message in client.generate(aborted, timeout=60):
            messages.append(message)
            if len(messages) == 1:
                assert client.abort("to-abort")
        assert messages[-1].finish_reason == "abort"
    finally:
        client.close()
    got = since(before, cluster)
    after = cluster.service.counters.by_status
    changed = {k: after[k] - statuses.get(k, 0) for k in after if after[k] != statuses.get(k, 0)}
    assert changed == {"INTERNAL": 1, "CANCELLED": 1}
    assert got[FIRST].count == 2  # both had a first token
    assert got[E2E].count == got[PROMPT].count == got[GENERATED].count == 0
    assert_no_leak(cluster)
