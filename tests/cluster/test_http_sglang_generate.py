"""SGLang's native `POST /generate` on a real cluster, as SGLang's own clients send it (plain
JSON over HTTP): the same answer as the completions API for the same request, text or ids,
alone or batched, whole or streamed, with SGLang's finish reasons, counts and logprobs; every
refusal named as SGLang names the field."""

from __future__ import annotations

import base64
import itertools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2 as httpx
import openai
import pytest

from tests.cluster.local_cluster import SERVED_NAME, LocalCluster
from tests.worker.vlm_fixtures import png_bytes

PROMPT = "The router sends each prompt to the worker that"
PNG = "data:image/png;base64," + base64.b64encode(png_bytes(8, 8, seed=1)).decode()
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def post(cluster: LocalCluster, path: str, body: dict[str, Any]) -> Any:
    answer = httpx.post(cluster.http_url + path, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


STILL = {"max_new_tokens": 2, "ignore_eos": True}
"""A request after a refusal, to see the router serves on."""


def generate(cluster: LocalCluster, body: dict[str, Any]) -> Any:
    return post(cluster, "/generate", body)


def test_a_text_prompt_answers_as_the_completions_api(
    cluster: LocalCluster, client: openai.OpenAI
) -> None:
    out = generate(cluster, {"text": PROMPT, "sampling_params": GREEDY, "rid": "sg-1"})
    same = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out["text"] == same.choices[0].text
    meta = out["meta_info"]
    assert same.usage is not None
    assert meta["id"] == "sg-1"
    assert meta["prompt_tokens"] == same.usage.prompt_tokens
    assert meta["completion_tokens"] == len(out["output_ids"]) == same.usage.completion_tokens
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["e2e_latency"] > 0
    ids = post(cluster, "/tokenize", {"model": SERVED_NAME, "prompt": PROMPT})["tokens"]
    by_ids = generate(cluster, {"input_ids": ids, "sampling_params": GREEDY})
    assert (by_ids["text"], by_ids["output_ids"]) == (out["text"], out["output_ids"])
    assert by_ids["meta_info"]["cached_tokens"] > 0  # the same prompt, routed to its cache
    assert post(cluster, "/detokenize", {"tokens": out["output_ids"]})["prompt"] == out["text"]


def test_a_batch_answers_a_list_in_order(cluster: LocalCluster) -> None:
    other = "Every page of the pool is"
    alone = [generate(cluster, {"text": t, "sampling_params": GREEDY}) for t in (PROMPT, other)]
    both = generate(cluster, {"text": [PROMPT, other], "sampling_params": GREEDY})
    assert [b["text"] for b in both] == [a["text"] for a in alone]
    assert [b["meta_info"]["prompt_tokens"] for b in both] == [
        a["meta_info"]["prompt_tokens"] for a in alone
    ]
    named = generate(
        cluster, {"text": [PROMPT, other], "sampling_params": GREEDY, "rid": ["a-1", "b-2"]}
    )
    assert [b["meta_info"]["id"] for b in named] == ["a-1", "b-2"]
    one = generate(cluster, {"text": [PROMPT, other], "sampling_params": GREEDY, "rid": "x"})
    assert [b["meta_info"]["id"] for b in one] == ["x_0", "x_1"]  # SGLang's
    drawn = {"max_new_tokens": 8, "n": 2, "sampling_seed": 3, "ignore_eos": True}
    two = generate(cluster, {"text": PROMPT, "sampling_params": drawn, "rid": "pair"})
    assert [t["meta_info"]["completion_tokens"] for t in two] == [8, 8]
    assert [t["meta_info"]["id"] for t in two] == ["pair", "pair"]


def test_a_stream_sends_the_text_so_far_then_done(cluster: LocalCluster) -> None:
    whole = generate(cluster, {"text": PROMPT, "sampling_params": GREEDY})
    body = {"text": PROMPT, "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/generate", json=body, timeout=60) as answer:
        assert answer.status_code == 200
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    texts = [e["text"] for e in events]
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert texts[-1] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_a_batch_streams_each_prompts_events_by_index(cluster: LocalCluster) -> None:
    texts = [PROMPT, "Every page of the pool is"]
    whole = generate(cluster, {"text": texts, "sampling_params": GREEDY})
    body = {"text": texts, "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", f"{cluster.http_url}/generate", json=body, timeout=60) as answer:
        lines = [line for line in answer.iter_lines() if line]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    last = {e["index"]: e for e in events}
    assert sorted(last) == [0, 1]
    assert [last[i]["text"] for i in (0, 1)] == [w["text"] for w in whole]


def test_logprobs_of_the_answer_and_the_prompt(
    cluster: LocalCluster, client: openai.OpenAI
) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": GREEDY,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "logprob_start_len": 3,
        "return_text_in_logprobs": True,
    }
    meta = (out := generate(cluster, body))["meta_info"]
    same = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )
    assert same.choices[0].logprobs is not None
    chosen = meta["output_token_logprobs"]
    assert [token for _, token, _ in chosen] == out["output_ids"]
    assert [text for _, _, text in chosen] == same.choices[0].logprobs.tokens
    wanted = same.choices[0].logprobs.token_logprobs
    assert [lp for lp, _, _ in chosen] == pytest.approx(wanted, abs=1e-4)
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * 8
    assert meta["output_top_logprobs"][0][0][0] >= meta["output_top_logprobs"][0][1][0]
    scored = meta["input_token_logprobs"]
    assert len(scored) == meta["prompt_tokens"] - 3 == len(meta["input_top_logprobs"])
    assert all(lp <= 0 for lp, _, _ in scored)
    start = generate(cluster, {**body, "logprob_start_len": 0})["meta_info"]
    assert start["input_token_logprobs"][0][0] is None and start["input_top_logprobs"][0] is None
    assert start["input_token_logprobs"][3:] == scored
    quiet = generate(cluster, {**body, "return_text_in_logprobs": False})["meta_info"]
    assert {text for _, _, text in quiet["output_token_logprobs"]} == {None}
    plain = generate(cluster, {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    assert plain["meta_info"]["input_token_logprobs"] == []  # SGLang writes the key regardless
    assert len(plain["meta_info"]["output_token_logprobs"]) == 8
    assert "output_top_logprobs" not in plain["meta_info"]


def test_nulls_and_what_asks_for_nothing_are_accepted(cluster: LocalCluster) -> None:
    """SGLang's fields are optional: null is the default, as there."""
    body = {
        "text": PROMPT,
        "sampling_params": {**GREEDY, "ignore_eos": None, "stop": None, "n": None},
        "return_logprob": None,
        "logprob_start_len": None,
        "stream": None,
        "image_data": None,
        "return_hidden_states": False,
        "log_metrics": True,
    }
    assert generate(cluster, body)["meta_info"]["completion_tokens"] == 8


def test_without_max_new_tokens_128_or_the_room_left(cluster: LocalCluster) -> None:
    short = generate(cluster, {"text": PROMPT, "sampling_params": {"ignore_eos": True}})
    assert short["meta_info"]["completion_tokens"] == 128  # SGLang's default
    ids = generate(cluster, {"text": PROMPT, "sampling_params": GREEDY})["output_ids"]
    long = (ids * 200)[:1010]  # 14 positions of the 1,024-token context left
    filled = generate(cluster, {"input_ids": long, "sampling_params": {"ignore_eos": True}})
    assert filled["meta_info"]["completion_tokens"] == 14
    assert filled["meta_info"]["finish_reason"] == {"type": "length", "length": 14}


def test_abort_request_ends_a_running_generation(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's `/abort_request`, while the engines are held mid-stream: the abort waits in
    each engine's inbox and ends the sample when it steps again."""
    info = httpx.get(f"{cluster.http_url}/get_model_info", timeout=10).json()
    assert info == {"model_path": SERVED_NAME, "tokenizer_path": SERVED_NAME, "is_generation": True}
    release = cluster.hold_engines_after(4, monkeypatch)
    body = {
        "text": PROMPT,
        "rid": "to-abort",
        "stream": True,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    url = f"{cluster.http_url}/generate"
    try:
        with (
            httpx.stream("POST", url, json=body, timeout=60) as answer,
            ThreadPoolExecutor(1) as pool,
        ):
            lines = answer.iter_lines()
            assert next(lines).startswith("data: ")
            asked = pool.submit(post, cluster, "/abort_request", {"rid": "to-abort"})
            (busy,) = [e for e in cluster.engines.values() if e._requests]
            deadline = time.monotonic() + 10
            while busy._inbox.empty() and not asked.done():  # held, or taken at once
                assert time.monotonic() < deadline
                time.sleep(0.01)
            release.set()
            assert asked.result(timeout=30) == {"aborted": ["to-abort"]}
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finally:
        release.set()
    finish = events[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and events[-1]["meta_info"]["completion_tokens"] < 200
    assert post(cluster, "/abort_request", {"rid": "to-abort"}) == {"aborted": []}
    both = {"rid": "to-abort", "abort_all": True, "abort_message": "bye"}  # abort_all wins
    assert post(cluster, "/abort_request", both) == {"aborted": []}
    nothing = httpx.post(f"{cluster.http_url}/abort_request", json={}, timeout=10)
    assert nothing.status_code == 400 and nothing.json()["error"]["param"] == "rid"


def test_a_batch_takes_a_sampling_params_each(cluster: LocalCluster) -> None:
    """A list of sampling_params, one per prompt: each prompt answered as if sent alone with
    its own, in one request, under `{rid}_{i}`."""
    own = [
        {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "stop_token_ids": [2]},
    ]
    prompts = [PROMPT, PROMPT + " knows"]
    alone = [
        generate(cluster, {"text": t, "sampling_params": s})
        for t, s in zip(prompts, own, strict=True)
    ]
    both = generate(cluster, {"text": prompts, "sampling_params": own, "rid": "pair"})
    assert [a["output_ids"] for a in both] == [a["output_ids"] for a in alone]
    assert [a["meta_info"]["completion_tokens"] for a in both] == [3, 5]
    assert [a["meta_info"]["id"] for a in both] == ["pair_0", "pair_1"]
    cluster.wait_idle()


def test_log_metrics_false_leaves_the_request_out_of_the_metrics(cluster: LocalCluster) -> None:
    service = cluster.service

    def requests() -> int:
        usage = service.tenants.tenants.get("")
        return usage.requests if usage is not None else 0

    for log_metrics, counted in ((False, 0), (True, 1), (None, 1)):
        ok, asked, timed = service.counters.by_status.get("OK", 0), requests(), ended(service)
        body = {"text": PROMPT, "sampling_params": GREEDY, "log_metrics": log_metrics}
        assert generate(cluster, body)["meta_info"]["completion_tokens"] == 8
        assert service.counters.by_status.get("OK", 0) == ok + counted, log_metrics
        assert requests() == asked + counted, log_metrics
        assert ended(service) == timed + counted, log_metrics
    cluster.wait_idle()


def ended(service: Any) -> float:
    """The calls the router's latency histogram timed to their end."""
    (family,) = service.latencies.end_to_end.collect()
    return next(s.value for s in family.samples if s.name.endswith("_count"))


def test_stops_say_what_they_matched(cluster: LocalCluster) -> None:
    free = generate(cluster, {"text": PROMPT, "sampling_params": {**GREEDY, "ignore_eos": True}})
    word = free["text"][2:5]
    assert word.strip(), free["text"]
    stopped = generate(cluster, {"text": PROMPT, "sampling_params": {**GREEDY, "stop": [word]}})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in stopped["text"]
    token = free["output_ids"][1]
    by_id = {**GREEDY, "stop_token_ids": [token]}
    ended = generate(cluster, {"text": PROMPT, "sampling_params": by_id})
    assert ended["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    past = generate(cluster, {"text": PROMPT, "sampling_params": {**by_id, "ignore_eos": True}})
    assert past["output_ids"] == free["output_ids"]  # ignore_eos: stop ids too, as in SGLang
    assert past["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    regex = {**GREEDY, "regex": "[ab]{4}"}
    shaped = generate(cluster, {"text": PROMPT, "sampling_params": regex})
    assert re.fullmatch("[ab]{4}", shaped["text"])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": PROMPT, "input_ids": [1, 2]}, "text", "exactly one of text or input_ids"),
        ({"text": PROMPT, "custom": "x"}, "custom", "unknown parameter"),
        ({"text": PROMPT, "log_metrics": "yes"}, "log_metrics", "valid boolean"),
        ({"text": PROMPT, "image_data": PNG}, "image_data", "no vision encoder"),
        ({"text": PROMPT, "video_data": "x"}, "video_data", "video is not served"),
        ({"text": PROMPT, "sampling_params": {"max_new_tokens": 0}}, None, "max_new_tokens"),
        ({"text": PROMPT, "sampling_params": {"temperature": -1}}, None, "temperature"),
        (
            {"text": PROMPT, "sampling_params": {"n": 2, "temperature": 0}},
            "sampling_params.n",
            "temperature > 0",
        ),
        ({"text": PROMPT, "sampling_params": {"best": 1}}, "sampling_params.best", "unknown"),
        (
            {"text": PROMPT, "sampling_params": {"spaces_between_special_tokens": False}},
            "sampling_params.spaces_between_special_tokens",
            "True",
        ),
        (
            {"text": PROMPT, "sampling_params": {"regex": "a", "ebnf": "root ::= 'a'"}},
            "sampling_params.regex",
            "one constraint",
        ),
        ({"text": [PROMPT, PROMPT], "rid": ["one"]}, "rid", "1 ids for 2 prompts"),
        ({"text": PROMPT, "rid": "no spaces allowed"}, "rid", "1-128 characters"),
        (
            {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0, "stream": True},
            "logprob_start_len",
            "stream",
        ),
        ({"input_ids": [1, 10**6]}, "input_ids", "token 1000000"),
        ({"text": PROMPT, "lora_path": "nope"}, "lora_path", "nope"),
        (
            {"text": PROMPT, "sampling_params": {"json_schema": "5"}},
            "sampling_params.json_schema",
            "a JSON int, not a schema",
        ),
        (
            {"text": PROMPT, "sampling_params": {"json_schema": "[" * 50_000}},
            "sampling_params.json_schema",
            "is not JSON",
        ),
        ({"text": PROMPT, "sampling_params": {"stop": [""]}}, "sampling_params.stop[0]", ""),
        (
            {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3},
            "logprob_start_len",
            "past the prompt's 3 tokens",
        ),
        (
            {"text": "a b", "return_logprob": True, "logprob_start_len": 40},
            "logprob_start_len",
            "past the prompt's",
        ),
        ({"text": PROMPT, "sampling_params": [GREEDY]}, "sampling_params", "one entry per prompt"),
        ({"text": ["a"] * 257, "sampling_params": [GREEDY] * 257}, "text", "send 1 to 256"),
        ({"text": [], "sampling_params": []}, "text", "0 prompts"),
        (
            {"text": ["a"], "sampling_params": [{"json_schema": "5"}]},
            "sampling_params[0].json_schema",
            "not a schema",
        ),
        (
            {"text": [PROMPT, PROMPT], "sampling_params": [GREEDY]},
            "sampling_params",
            "1 entries for 2 prompts",
        ),
        (
            {
                "text": ["a", "b"],
                "sampling_params": [{"n": 2, "temperature": 1}, {"temperature": 1}],
            },
            "sampling_params[1].n",
            "the same n (2)",
        ),
        (
            {"input_ids": [[1, 2], [3]], "sampling_params": [GREEDY, {"json_schema": "5"}]},
            "sampling_params[1].json_schema",
            "a JSON int, not a schema",
        ),
        (
            {
                "input_ids": [[1, 2], [3, 4]],
                "return_logprob": True,
                "logprob_start_len": 2,
                "sampling_params": [GREEDY, GREEDY],
            },
            "logprob_start_len",
            "past the prompt's 2 tokens",
        ),
    ],
)
def test_a_refusal_names_sglangs_field(
    cluster: LocalCluster, body: dict[str, Any], param: str | None, words: str
) -> None:
    answer = httpx.post(f"{cluster.http_url}/generate", json=body, timeout=60)
    assert answer.status_code in (400, 404), answer.text
    error = answer.json()["error"]
    expected = param if param is not None else f"sampling_params.{words}"
    assert error["param"] == expected and words in error["message"], error
    # the router serves on (two tokens, whatever their text: a sampled one may be half a
    # character, held back)
    served = generate(cluster, {"text": "still", "sampling_params": STILL})
    assert served["meta_info"]["completion_tokens"] == 2
