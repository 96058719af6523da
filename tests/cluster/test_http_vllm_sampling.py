"""vLLM's sampling parameters beyond OpenAI's (min_p, min_tokens, allowed_token_ids,
include_stop_str_in_output, skip_special_tokens, sent in the SDK's extra_body) and OpenAI's
logit_bias, through the `openai` SDK over real HTTP on loopback to a local cluster of two
tiny-model workers; each bad value a 400 naming it, the cluster serving on."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster
from tests.cluster.test_http_openai import assert_no_leak
from tests.cluster.tool_fixtures import served
from worker.loader import LoadedModel

MODEL = SERVED_NAME
PROMPT = "the quick brown fox jumps over the lazy dog"
EOS = 2
"""The tiny model's `<|im_end|>`."""


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(tiny, ENGINE)


def complete(client: openai.OpenAI, max_tokens: int = 12, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, **kwargs)


def piece(cluster: LocalCluster, token: int) -> str:
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    return tokenizer.decode([token], skip_special_tokens=False)


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, cluster: LocalCluster) -> None:
    plain = complete(client, extra_body={"ignore_eos": True}).choices[0].text
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    forced = tokenizer.encode(" lazy")[-1]
    text = complete(client, logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert text.choices[0].text == piece(cluster, forced) * 12
    first = tokenizer.encode(plain)[0]
    banned = complete(client, logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert not banned.choices[0].text.startswith(piece(cluster, first))
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == piece(cluster, forced) * 4
    assert_no_leak(cluster)


def test_allowed_token_ids_confine_every_sample(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    allowed = sorted(set(tokenizer.encode(" quick brown")))
    pieces = "|".join(re.escape(piece(cluster, t)) for t in allowed)
    answer = complete(
        client,
        n=4,
        temperature=1.0,
        seed=11,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    texts = [c.text for c in answer.choices]
    assert len(set(texts)) > 1, "four samples at temperature 1 should differ"
    for text in texts:
        assert re.fullmatch(f"(?:{pieces})+", text), text
    assert_no_leak(cluster)


def test_min_p_of_one_keeps_only_the_most_likely_token(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    greedy = complete(client, extra_body={"ignore_eos": True}).choices[0].text
    sampled = complete(
        client, n=3, temperature=1.0, seed=4, extra_body={"min_p": 1.0, "ignore_eos": True}
    )
    assert [c.text for c in sampled.choices] == [greedy] * 3
    unfiltered = complete(client, n=3, temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    assert [c.text for c in unfiltered.choices] != [greedy] * 3
    assert_no_leak(cluster)


def test_min_tokens_passes_over_early_stop_strings_and_the_stop_string_may_stay(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    ask: dict[str, Any] = {"max_tokens": 32, "extra_body": {"ignore_eos": True}}
    whole = complete(client, **ask).choices[0].text
    # a character of the first few that comes again well after them
    stop = next(c for c in whole[:3] if c.isascii() and whole.rfind(c) >= 12)
    cut = complete(client, stop=stop, **ask)
    assert cut.choices[0].text == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    held_off = {"ignore_eos": True, "min_tokens": 6}
    held = complete(client, max_tokens=32, stop=stop, extra_body=held_off)
    text = held.choices[0].text
    assert held.choices[0].finish_reason == "stop"
    assert held.usage is not None and held.usage.completion_tokens > 6
    assert len(text) > whole.index(stop) and whole[len(text)] == stop
    kept_in = {**held_off, "include_stop_str_in_output": True}
    kept = complete(client, max_tokens=32, stop=stop, extra_body=kept_in)
    assert kept.choices[0].text == text + stop
    streamed = complete(client, max_tokens=32, stop=stop, stream=True, extra_body=kept_in)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text + stop
    assert_no_leak(cluster)


def test_a_stop_token_s_text_stays_with_include_stop_str_in_output(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    tokenizer = cluster.links.tokenizer
    assert tokenizer is not None
    token = tokenizer.encode(" lazy")[-1]
    forced = {"ignore_eos": True, "stop_token_ids": [token]}
    cut = complete(client, logit_bias={str(token): 100}, extra_body=forced)
    assert cut.choices[0].text == "" and cut.choices[0].finish_reason == "stop"
    kept = complete(
        client,
        logit_bias={str(token): 100},
        extra_body={**forced, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == piece(cluster, token)
    assert_no_leak(cluster)


def test_skip_special_tokens_false_writes_them(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    ask = {"allowed_token_ids": [EOS], "ignore_eos": True}
    skipped = complete(client, max_tokens=3, extra_body=ask)
    assert skipped.choices[0].text == ""
    written = complete(client, max_tokens=3, extra_body={**ask, "skip_special_tokens": False})
    assert written.choices[0].text == "<|im_end|>" * 3
    assert_no_leak(cluster)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias.05"),
        ({"logit_bias": {"9999": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, 9999]}, "allowed_token_ids"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"bad_words": ["fox", " "]}, "bad_words[1]"),
        ({"allowed_token_ids": [EOS], "min_tokens": 1}, "allowed_token_ids"),
    ],
)
def test_each_bad_value_is_a_400_naming_it(
    cluster: LocalCluster, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, **fields}
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    assert_no_leak(cluster)
    served = httpx.post(
        f"{cluster.http_url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
    )
    assert served.status_code == 200


def test_bad_words_change_the_greedy_answer(client: openai.OpenAI, cluster: LocalCluster) -> None:
    plain = complete(client, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    words = [w for w in plain.split() if w.isascii() and len(w) > 1]
    assert words, plain
    banned = complete(
        client, max_tokens=16, extra_body={"ignore_eos": True, "bad_words": words[:1]}
    )
    assert banned.choices[0].text != plain
    assert_no_leak(cluster)


def test_bad_words_are_spelled_off_the_workers_event_loop(
    client: openai.OpenAI, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spelling 256 long bad words takes the tokenizer seconds: the worker submits such a
    request from a thread of its own, so its gRPC event loop (the local cluster's thread) goes
    on streaming every other request meanwhile."""
    threads: list[str] = []
    for engine in cluster.engines.values():
        submit = engine.submit

        def recorded(request: Any, sink: Any, submit: Any = submit) -> int:
            threads.append(threading.current_thread().name)
            return submit(request, sink)

        monkeypatch.setattr(engine, "submit", recorded)
    complete(client, max_tokens=2, extra_body={"bad_words": ["lazy cat " * 8] * 4})
    complete(client, max_tokens=2)
    assert len(threads) == 2, threads
    assert threads[0] != "local-cluster" and threads[1] == "local-cluster", threads
    assert_no_leak(cluster)
