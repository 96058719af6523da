"""The router's text index on the serving path: real gRPC and HTTP on loopback, real engines.

Multi-turn plain-text conversations whose turns are appended without a separator: in `exact`
mode the router's ids are those of a full tokenization (the prompt token counts say so, and the
outputs equal a cold run on those ids); in `anchored` mode the next turn reuses the ids the
model generated (the worker serves them from its cache) and the outputs equal a cold run on the
ids the router sent. The index never crosses tenants.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster.client import Client, text_request
from cluster.config import RouterSection, TextIndexSection
from cluster.router_metrics import RouterCollector
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import LocalCluster, start_cluster
from worker.loader import LoadedModel

HISTORY = "The router keeps the text of every conversation it has seen, and the ids"
QUESTIONS = (" of the tokens betw", "een them; so the next tur", "n tokenises only what is new.")


@pytest.fixture
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny, workers=1, http=True)
    yield running
    running.close()


def generate(
    client: Client, text: str | None, mode: int, tenant: str = "", ids: list[int] | None = None
) -> tuple[list[int], serving_pb2.GenerateResponse]:
    """Greedy: the generated ids and the last message (prompt and cache counts)."""
    request = text_request(text, token_ids=ids, max_tokens=6, tenant=tenant)
    request.text_match = mode
    responses = list(client.generate(request, timeout=30))
    generated = [i for r in responses for i in r.token_ids]
    return generated, responses[-1]


def test_exact_mode_sends_full_tokenization_ids_and_reuses_the_history(
    cluster: LocalCluster, tiny: LoadedModel
) -> None:
    client, tokenizer = Client(cluster.target), tiny.tokenizer
    prompt = HISTORY
    for question in QUESTIONS:
        sent = prompt
        generated, last = generate(client, prompt, serving_pb2.TEXT_MATCH_EXACT)
        full = tokenizer.encode(prompt)
        assert last.prompt_tokens == len(full)
        cold, _ = generate(client, None, serving_pb2.TEXT_MATCH_OFF, tenant="cold", ids=full)
        assert generated == cold  # the same ids: the same answer as a cold run
        prompt += tokenizer.decode(generated) + question  # no separator between turns
        cluster.wait_idle()
    counters = cluster.service.text_prompts.counters  # type: ignore[union-attr]
    assert counters.prompts == len(QUESTIONS)
    assert counters.reused_chars > len(HISTORY)  # later turns reused the earlier ones
    assert counters.outcomes.get("split", 0) == len(QUESTIONS) - 1
    stats = cluster.stats().text_index  # what `radixmesh stats` prints
    assert (stats.mode, stats.prompts) == ("exact", len(QUESTIONS))
    assert stats.reused_chars == counters.reused_chars and stats.chars >= len(sent)
    metrics = {
        family.name: family.samples[0].value
        for family in RouterCollector(cluster.service).collect()
        if family.name.startswith("radixmesh_router_text_index") and family.samples
    }
    assert metrics["radixmesh_router_text_index_reused_chars"] == counters.reused_chars
    assert metrics["radixmesh_router_text_index_chars"] == stats.chars


def test_anchored_mode_reuses_the_generated_ids_and_the_worker_serves_them(
    cluster: LocalCluster, tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, tokenizer = Client(cluster.target), tiny.tokenizer
    generate(client, "warm", serving_pb2.TEXT_MATCH_ANCHORED, tenant="warm-up")  # builds the index
    texts = cluster.service.text_prompts
    assert texts is not None
    joining = texts.finished

    def slow_join(*args: Any) -> None:  # an answer that takes long to join the index
        time.sleep(0.3)
        joining(*args)

    monkeypatch.setattr(texts, "finished", slow_join)
    generated, _ = generate(client, HISTORY, serving_pb2.TEXT_MATCH_ANCHORED)
    cluster.wait_idle()
    answer = tokenizer.decode(generated, skip_special_tokens=False)
    prompt = HISTORY + answer + QUESTIONS[0]
    anchored_ids = [
        *tokenizer.encode(HISTORY),
        *generated,
        *tokenizer.encode(QUESTIONS[0], add_special_tokens=False),
    ]
    # the answer ("Thatadict..." continues "ids" without a space): tokenising the whole text
    # gives other ids than the generated ones, which only anchored mode reuses
    assert anchored_ids != tokenizer.encode(prompt)
    # sent at once: the router waits for the first answer to join the index before matching
    second, last = generate(client, prompt, serving_pb2.TEXT_MATCH_ANCHORED)
    assert last.prompt_tokens == len(anchored_ids)
    page = cluster.config.engine.page_size
    computed = len(tokenizer.encode(HISTORY)) + len(generated) - 1  # the last one was not fed
    assert last.cached_prompt_tokens >= computed // page * page
    cold, _ = generate(client, None, serving_pb2.TEXT_MATCH_OFF, tenant="cold", ids=anchored_ids)
    assert second == cold  # the engine's output for the ids it got equals a cold run on them
    assert texts.counters.outcomes.get("extend", 0) == 1


def test_the_index_never_crosses_tenants(cluster: LocalCluster) -> None:
    client = Client(cluster.target)
    generate(client, HISTORY, serving_pb2.TEXT_MATCH_ANCHORED, tenant="acme")
    cluster.wait_idle()
    texts = cluster.service.text_prompts
    assert texts is not None
    generate(client, HISTORY + QUESTIONS[0], serving_pb2.TEXT_MATCH_ANCHORED, tenant="globex")
    assert texts.counters.outcomes.get("miss", 0) == 2  # acme's first turn, globex's first
    assert texts.counters.reused_chars == 0


def test_http_requests_choose_a_mode_and_a_bad_one_is_named(cluster: LocalCluster) -> None:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        for mode in ("exact", "anchored", "off"):
            c.completions.create(
                model="tiny",
                prompt=HISTORY,
                max_tokens=2,
                temperature=0,
                extra_body={"text_match": mode},
            )
        with pytest.raises(openai.BadRequestError, match="text_match"):
            c.completions.create(
                model="tiny", prompt=HISTORY, max_tokens=2, extra_body={"text_match": "fuzzy"}
            )
    texts = cluster.service.text_prompts
    assert texts is not None and texts.counters.prompts == 2  # "off" bypasses the index


def test_an_embedding_takes_exact_ids_under_an_anchored_default(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's default is `anchored`; a generation then leaves ids for a text that a full
    tokenization spells otherwise. A chat's next turn reuses them; an embedding of that text
    that does not ask for a mode takes the full tokenization (the same text embeds the same
    whatever was said before), and one that asks for `anchored` gets it."""
    router = RouterSection(port=0, text_index=TextIndexSection(mode="anchored"))
    cluster = start_cluster(tiny, workers=1, router=router)
    try:
        client, tokenizer = Client(cluster.target), tiny.tokenizer
        generate(client, "warm", serving_pb2.TEXT_MATCH_DEFAULT, tenant="warm-up")
        generated, _ = generate(client, HISTORY, serving_pb2.TEXT_MATCH_DEFAULT)
        cluster.wait_idle()
        prompt = HISTORY + tokenizer.decode(generated, skip_special_tokens=False) + QUESTIONS[0]
        anchored = [
            *tokenizer.encode(HISTORY),
            *generated,
            *tokenizer.encode(QUESTIONS[0], add_special_tokens=False),
        ]
        exact = tokenizer.encode(prompt)
        assert anchored != exact

        def embedded(mode: int, text: str | None, ids: list[int] | None = None) -> list[float]:
            request = text_request(text, token_ids=ids)
            request.pooling.SetInParent()
            request.text_match = mode
            (message,) = list(client.generate(request, timeout=30))
            return list(message.embedding)

        asked = embedded(serving_pb2.TEXT_MATCH_ANCHORED, prompt)  # first: once a request
        by_default = embedded(serving_pb2.TEXT_MATCH_DEFAULT, prompt)  # keeps exact ids, they match
        of_exact = embedded(serving_pb2.TEXT_MATCH_DEFAULT, None, exact)
        of_anchored = embedded(serving_pb2.TEXT_MATCH_DEFAULT, None, anchored)
        assert by_default == pytest.approx(of_exact, abs=1e-5)
        assert asked == pytest.approx(of_anchored, abs=1e-5)
        assert of_exact != pytest.approx(of_anchored, abs=1e-3)
    finally:
        cluster.close()
