"""Every refusal of the HTTP API, over real HTTP on loopback: the status, OpenAI's error object
(Anthropic's on /v1/messages) and a message naming the field; after each, the server still
serves and no page is left behind.

The bad inputs of the gRPC test (tests/cluster/test_serving.py `BAD`) in their HTTP form, the
parameters radixmesh refuses rather than ignore, 401 / 403 / 404 / 413, and the counter of
answers by route and status. 429 and 503: test_http_overload.py.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import httpx2 as httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cluster.config import RouterSection, SecuritySection
from cluster.http import body_limit
from cluster.http.body_limit import DISCARD_BYTES
from cluster.router_metrics import RouterCollector
from tests.cluster.local_cluster import ENGINE, SERVED_NAME, LocalCluster, start_cluster
from worker.loader import LoadedModel

MODEL = SERVED_NAME
TOKENS = {"token-any": "*", "token-acme": "acme"}
AUTH = {"Authorization": "Bearer token-any"}
MAX_BODY = 1 << 16
MAX_PROMPT_CHARS = 8000


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    cluster = start_cluster(
        tiny,
        http=True,
        router=RouterSection(port=0, max_message_bytes=MAX_BODY),
        security=SecuritySection(auth_tokens=TOKENS),
        engine=replace(ENGINE, max_prompt_chars=MAX_PROMPT_CHARS),
    )
    yield cluster
    cluster.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    url = f"{cluster.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="token-any", max_retries=0) as c:
        yield c


def assert_still_serving(client: openai.OpenAI, cluster: LocalCluster) -> None:
    answer = client.completions.create(model=MODEL, prompt="still serving?", max_tokens=3)
    assert answer.choices[0].finish_reason in ("stop", "length")
    cluster.wait_idle()  # nothing running or waiting, no private page on any engine
    assert not cluster.service.in_flight


def assert_openai_error(response: httpx.Response, status: int, words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(response.json()) == {"error"}
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    return dict(error)


class Bad(NamedTuple):
    body: dict[str, Any]
    """Over a 4-token greedy text completion (`messages`: a chat completion)."""
    status: int
    words: str
    param: str | None
    headers: dict[str, str] | None = None
    code: str | None = None
    """OpenAI's error code: context_length_exceeded for a prompt the context cannot hold."""


OVERFLOW = "context_length_exceeded"
NOT_IN_THE_SDK = {
    "stop_token_ids",
    "guided_json",
    "guided_regex",
    "guided_whitespace_pattern",
    "structured_outputs",
    "prompt_logprobs",
}


def tool(name: str, parameters: dict[str, object] | None = None) -> dict[str, object]:
    schema = parameters or {"type": "object", "properties": {"x": {"type": "integer"}}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}
BAD = {
    "empty prompt": Bad({"prompt": ""}, 400, "prompt: is empty", "prompt"),
    "empty ids": Bad({"prompt": []}, 400, "prompt", "prompt"),
    "no room": Bad({"prompt": "word " * 600}, 400, "leave no room", "prompt", code=OVERFLOW),
    "no room, OpenAI's words": Bad(
        {"prompt": "word " * 600},
        400,
        "This model's maximum context length is",
        "prompt",
        code=OVERFLOW,
    ),
    "chat no room": Bad(
        {"messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "leave no room",
        "prompt",
        code=OVERFLOW,
    ),
    "suffix, no fill-in-the-middle": Bad(
        {"suffix": "return x"}, 400, "no fill-in-the-middle tokens", "suffix"
    ),
    "suffix not text": Bad({"suffix": 5}, 400, "valid string", "suffix"),
    "id past vocab": Bad({"prompt": [1, 2, 10**6]}, 400, "token 1000000", "prompt_token_ids"),
    "negative id": Bad({"prompt": [1, -5]}, 400, "prompt: -5", "prompt"),
    "adapter": Bad({"model": f"{MODEL}:sql-lora"}, 404, "does not exist", "model"),
    "temperature": Bad({"temperature": -1}, 400, "temperature: must be >= 0", "temperature"),
    "top_p 0": Bad({"top_p": 0}, 400, "top_p", "top_p"),
    "top_p 1.5": Bad({"top_p": 1.5}, 400, "top_p", "top_p"),
    "max_tokens 0": Bad({"max_tokens": 0}, 400, "max_tokens: must be in", "max_tokens"),
    "max_tokens 1e9": Bad(
        {"max_tokens": 10**9}, 400, "you requested 1000000", "max_tokens", code=OVERFLOW
    ),
    "max_completion_tokens 0": Bad(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": None,
            "max_completion_tokens": 0,
        },
        400,
        "max_tokens: must be in",
        "max_tokens",
    ),
    "n 0": Bad({"n": 0}, 400, "n: must be in", "n"),
    "stop_token_ids": Bad({"stop_token_ids": [-3]}, 400, "stop_token_ids", "stop_token_ids"),
    "image for a text model": Bad(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]},
        400,
        "messages[0].content[1].image_url: this model has no vision encoder",
        "messages[0].content[1].image_url",
    ),
    "remote image": Bad(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
                    ],
                }
            ]
        },
        400,
        "the server fetches nothing; send a data URL",
        "messages[0].content[0].image_url",
    ),
    "audio part": Bad(
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        400,
        "messages[0].content[0]: expected a text part",
        "messages[0].content[0]",
    ),
    "no messages": Bad({"messages": []}, 400, "messages: is empty", "messages"),
    "tool message without its call": Bad(
        {"messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].tool_call_id: is required (the call answered)",
        "messages[0].tool_call_id",
    ),
    "a union's member is not named": Bad(
        {"messages": [{"role": "user", "content": 5}]}, 400, "valid string", "messages[0].content"
    ),
    "a union's literal is not named": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "always"},
        400,
        "'required'",
        "tool_choice",
    ),
    "the union's member meant is the one named": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function"}},
        400,
        "Field required",
        "tool_choice.function",
    ),
    "the one bad item of a list is named": Bad(
        {"prompt": ["the", "fox", 7]}, 400, "valid string", "prompt[2]"
    ),
    "unknown role": Bad(
        {"messages": [{"role": "robot", "content": "x"}]}, 400, "'robot'", "messages[0].role"
    ),
    "request id": Bad(
        {}, 400, "X-Request-Id", "X-Request-Id", {"X-Request-Id": "no spaces allowed"}
    ),
    "string max_tokens": Bad({"max_tokens": "8"}, 400, "max_tokens", "max_tokens"),
    # parameters radixmesh does not implement: refused by name, not ignored
    # tools: each refusal names the tool or the turn at fault
    "tool without a function": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        "tools[0].function: Field required",
        "tools[0].function",
    ),
    "tool name with a space": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool("get weather")]},
        400,
        "tools[0].function.name: 'get weather' is not 1-64 of a-z, A-Z, 0-9, _ and -",
        "tools[0].function.name",
    ),
    "tool declared twice": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool("f"), tool("f")]},
        400,
        "tools[1].function.name: 'f' is declared twice",
        "tools[1].function.name",
    ),
    "tool named like a mode": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool("none")]},
        400,
        "tools[0].function.name: 'none' is a mode of tool_choice",
        "tools[0].function.name",
    ),
    "tool whose arguments are no object": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool("f", {"type": "string"})]},
        400,
        "tools[0].function.parameters: a call's arguments are an object",
        "tools[0].function.parameters",
    ),
    "tool_choice naming no tool": Bad(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool("get_weather")],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        400,
        "tool_choice.function.name: 'nope' is not one of the tools: ['get_weather']",
        "tool_choice.function.name",
    ),
    "tool_choice required without tools": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
        400,
        "tool_choice: 'required' needs tools, and none are given",
        "tool_choice",
    ),
    "tools and a response format": Bad(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool("f")],
            "response_format": {"type": "json_object"},
        },
        400,
        "tools: 'auto' constrains the calls, and the request asks for a structured output",
        "tools",
    ),
    "parameters that do not compile": Bad(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool("f", {"type": "object", "properties": {"x": {"type": "nonsense"}}})],
        },
        400,
        'tools: does not compile: Unsupported type "nonsense"',
        "tools",
    ),
    "call arguments that are not JSON": Bad(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "tools": [tool("f")],
        },
        400,
        "messages[1].tool_calls[0].function.arguments: is not JSON",
        "messages[1].tool_calls[0].function.arguments",
    ),
    # structured outputs: refused by the router or by the worker's compiler, named as sent
    "schema that does not compile": Bad(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
        400,
        'response_format.json_schema.schema: does not compile: Unsupported type "nonsense"',
        "response_format.json_schema.schema",
    ),
    "json_schema without one": Bad(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema"},
        },
        400,
        "response_format.json_schema: is required with type json_schema",
        "response_format.json_schema",
    ),
    "schema that is not JSON": Bad(
        {"guided_json": "{not json"}, 400, "guided_json: is not JSON", "guided_json"
    ),
    "regex that does not compile": Bad(
        {"structured_outputs": {"regex": "a(b"}},
        400,
        "structured_outputs.regex: does not compile: Regex parsing error",
        "structured_outputs.regex",
    ),
    "two kinds in structured_outputs": Bad(
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs: set one of json, regex, choice, grammar, json_object, "
        "structural_tag; 2 are set",
        "structured_outputs",
    ),
    "two structured outputs": Bad(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
            "guided_regex": "a+",
        },
        400,
        "guided_regex: response_format asks for a structured output already",
        "guided_regex",
    ),
    "logit_bias by text": Bad(
        {"logit_bias": {"fox": 1}},
        400,
        "logit_bias.fox: the key is not a token id",
        "logit_bias.fox",
    ),
    "prompt_logprobs streamed": Bad(
        {"prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs: not available with stream",
        "prompt_logprobs",
    ),
    "too many prompts": Bad({"prompt": ["a"] * 257}, 400, "257 prompts", "prompt"),
    "top_logprobs alone": Bad(
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs: needs logprobs",
        "top_logprobs",
    ),
    "stream_options alone": Bad(
        {"stream_options": {"include_usage": True}}, 400, "stream_options", "stream_options"
    ),
    "unknown parameter": Bad(
        {"guided_whitespace_pattern": " "},
        400,
        "guided_whitespace_pattern: unknown",
        "guided_whitespace_pattern",
    ),
}


@pytest.mark.parametrize("case", BAD.values(), ids=BAD.keys())
def test_bad_input_is_refused_naming_the_field(
    client: openai.OpenAI, cluster: LocalCluster, case: Bad
) -> None:
    """Sent with the SDK as an application would (what it has no argument for in extra_body)."""
    chat = "messages" in case.body
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    base |= {} if chat else {"prompt": "the quick brown fox"}
    body = {k: v for k, v in (base | case.body).items() if v is not None}
    extra = {k: body.pop(k) for k in NOT_IN_THE_SDK & body.keys()}
    create = client.chat.completions.create if chat else client.completions.create
    with pytest.raises(openai.APIStatusError) as err:
        create(**body, extra_body=extra, extra_headers=case.headers)  # type: ignore[operator]
    assert err.value.status_code == case.status
    error = assert_openai_error(err.value.response, case.status, case.words)
    assert error["param"] == case.param
    kind = "not_found_error" if case.status == 404 else "invalid_request_error"
    assert error["type"] == kind and error["code"] == case.code
    assert_still_serving(client, cluster)


def test_the_no_op_values_of_refused_parameters_are_accepted(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        logit_bias={},
        extra_body={"tools": [], "store": False, "modalities": ["text"]},
    )
    assert chat.choices[0].message.role == "assistant"
    text = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, logit_bias={}, echo=False, extra_body={"suffix": ""}
    )
    assert text.choices[0].finish_reason in ("stop", "length")
    cluster.wait_idle()


@pytest.mark.parametrize(
    "body",
    [b'{"model": "tiny", "prompt": ', b"[1, 2]", b"", b"\xff\xfe"],
    ids=["cut", "array", "empty", "not utf-8"],
)
def test_a_body_that_is_not_a_json_object_is_400(cluster: LocalCluster, body: bytes) -> None:
    headers = AUTH | {"Content-Type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = httpx.post(f"{cluster.http_url}{path}", content=body, headers=headers)
        assert_openai_error(response, 400, "")
    messages = httpx.post(f"{cluster.http_url}/v1/messages", content=body, headers=headers)
    assert messages.status_code == 400 and messages.json()["type"] == "error"


def test_a_body_json_cannot_be_read_from_is_400_saying_why(cluster: LocalCluster) -> None:
    """Bodies FastAPI itself fails to parse (a byte that is not UTF-8 after valid ones; nesting
    past the parser's recursion) answer in each API's error shape, saying what was wrong."""
    headers = AUTH | {"Content-Type": "application/json"}
    not_utf8 = b'{"model": "tiny", "prompt": "caf\xe9"}'
    nested = b"[" * 5_000 + b"]" * 5_000
    for body, words in [(not_utf8, "body: is not UTF-8 text"), (nested, "nested too deeply")]:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            response = httpx.post(f"{cluster.http_url}{path}", content=body, headers=headers)
            assert assert_openai_error(response, 400, words)["param"] == "body"
        messages = httpx.post(f"{cluster.http_url}/v1/messages", content=body, headers=headers)
        assert messages.status_code == 400 and messages.json()["type"] == "error"
        assert words in messages.json()["error"]["message"]
    json_only = {"Content-Type": "application/json"}  # parsed as JSON, then failed: 401 first
    refused = httpx.post(f"{cluster.http_url}/v1/completions", content=not_utf8, headers=json_only)
    assert assert_openai_error(refused, 401, "a valid token is required")


@pytest.mark.parametrize("number", ["1e999", "Infinity"])
def test_an_infinite_temperature_is_400(
    client: openai.OpenAI, cluster: LocalCluster, number: str
) -> None:
    """JSON's 1e999 reads as infinity (the SDK cannot send one; a hand-written body can)."""
    body = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2, "temperature": {number}}}'
    headers = AUTH | {"Content-Type": "application/json"}
    response = httpx.post(f"{cluster.http_url}/v1/completions", content=body, headers=headers)
    error = assert_openai_error(response, 400, "temperature: must be >= 0 and finite, got inf")
    assert error["param"] == "temperature"
    assert_still_serving(client, cluster)


LONE = "\\ud800"
"""A JSON escape that decodes to a lone UTF-16 surrogate: no UTF-8 text can hold it."""
PAIR = "\\ud83d\\ude00"
"""A surrogate pair: one emoji."""


class Unicode(NamedTuple):
    path: str
    body: str
    """With LONE where the bad string goes."""
    field: str
    paired: int
    """The status with PAIR in its place (a key is an unknown parameter, a model unknown)."""


def chat(content: str, extra: str = "") -> str:
    return f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {content}{extra}}}]}}'


SURROGATES = {
    "chat content": Unicode("/v1/chat/completions", chat(f'"a{LONE}"'), "messages[0].content", 200),
    "chat text part": Unicode(
        "/v1/chat/completions",
        chat(f'[{{"type": "text", "text": "{LONE}"}}]'),
        "messages[0].content[0].text",
        200,
    ),
    "a key": Unicode("/v1/chat/completions", chat('"hi"', f', "x{LONE}": 1'), "messages[0]", 400),
    "prompt": Unicode(
        "/v1/completions", f'{{"model": "{MODEL}", "prompt": "{LONE}"}}', "prompt", 200
    ),
    "stop": Unicode(
        "/v1/completions",
        f'{{"model": "{MODEL}", "prompt": "hi", "stop": ["ok", "{LONE}"]}}',
        "stop[1]",
        200,
    ),
    "model": Unicode("/v1/completions", f'{{"model": "{LONE}", "prompt": "hi"}}', "model", 404),
    "tokenize": Unicode("/tokenize", f'{{"prompt": "{LONE}"}}', "prompt", 200),
    "messages": Unicode(
        "/v1/messages",
        f'{{"model": "{MODEL}", "max_tokens": 2, "system": "{LONE}", '
        f'"messages": [{{"role": "user", "content": "hi"}}]}}',
        "system",
        200,
    ),
    "count_tokens": Unicode(
        "/v1/messages/count_tokens", chat(f'"{LONE}"'), "messages[0].content", 200
    ),
}


@pytest.mark.parametrize("case", SURROGATES.values(), ids=SURROGATES.keys())
def test_a_lone_surrogate_is_400_naming_the_field(
    client: openai.OpenAI, cluster: LocalCluster, case: Unicode
) -> None:
    """JSON can spell a string no UTF-8 text can hold (it was a 500: protobuf cannot encode
    it); the same string with a surrogate pair is served."""
    headers = AUTH | {"Content-Type": "application/json"}
    url = f"{cluster.http_url}{case.path}"
    response = httpx.post(url, content=case.body, headers=headers)
    assert response.status_code == 400, response.text
    message = f"{case.field}: holds a lone UTF-16 surrogate (\\ud800)"
    if case.path.startswith("/v1/messages"):
        assert response.json()["error"]["message"].startswith(message), response.text
    else:
        assert assert_openai_error(response, 400, message)["param"] == case.field
    paired = httpx.post(url, content=case.body.replace(LONE, PAIR), headers=headers)
    assert paired.status_code == case.paired, paired.text
    assert_still_serving(client, cluster)


UNAUTHORIZED = [None, "Bearer wrong", "Bearer", "Basic token-any", "token-any", "Bearer token-an"]


@pytest.mark.parametrize("header", UNAUTHORIZED)
def test_a_missing_or_wrong_bearer_token_is_401(cluster: LocalCluster, header: str | None) -> None:
    headers = {"Authorization": header} if header is not None else {}
    url = cluster.http_url
    calls = [
        httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers),
        httpx.post(f"{url}/v1/completions", json={"prompt": 1}, headers=headers),  # 401 first
        httpx.get(f"{url}/v1/models", headers=headers),
        httpx.post(f"{url}/tokenize", json={"prompt": "x"}, headers=headers),
        httpx.get(f"{url}/version", headers=headers),
        httpx.post(f"{url}/generate", json={"text": "x"}, headers=headers),
    ]
    for response in calls:
        error = assert_openai_error(response, 401, "a valid token is required")
        assert error["type"] == "authentication_error"
    assert httpx.get(f"{url}/health").status_code == 200  # probes carry no token
    assert (
        httpx.get(f"{url}/ping").json()
        == httpx.post(f"{url}/ping").json()
        == {
            "status": "ok",
            "workers": len(cluster.engines),
        }
    )
    version = httpx.get(f"{url}/version", headers=AUTH).json()["version"]
    assert version == importlib.metadata.version("radixmesh")


def test_a_tenant_other_than_the_tokens_is_403(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    url = f"{cluster.http_url}/v1"
    with openai.OpenAI(base_url=url, api_key="token-acme", max_retries=0) as acme:
        with pytest.raises(openai.PermissionDeniedError) as err:
            acme.completions.create(
                model=MODEL,
                prompt="hi",
                max_tokens=2,
                extra_headers={"X-Radixmesh-Tenant": "globex"},
            )
        assert "'acme'" in err.value.message and err.value.type == "permission_error"
        own = acme.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Radixmesh-Tenant": "acme"}
        )
        assert own.choices
    anyone = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Radixmesh-Tenant": "globex"}
    )
    assert anyone.choices
    assert_still_serving(client, cluster)


def test_unknown_model_is_404_on_every_route(cluster: LocalCluster) -> None:
    url = cluster.http_url
    for path, body in [
        ("/v1/completions", {"model": "gpt-4o", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": []}),
        ("/tokenize", {"model": "gpt-4o", "prompt": "x"}),
        ("/v1/embeddings", {"model": "gpt-4o", "input": "x"}),
    ]:
        response = httpx.post(f"{url}{path}", json=body, headers=AUTH)
        assert assert_openai_error(response, 404, "'gpt-4o'")["param"] == "model"
    unknown_path = httpx.get(f"{url}/v1/audio/speech", headers=AUTH)
    assert_openai_error(unknown_path, 404, "no such endpoint: GET /v1/audio/speech")
    wrong_method = httpx.get(f"{url}/v1/completions", headers=AUTH)
    assert_openai_error(wrong_method, 405, "/v1/completions does not take GET")
    assert wrong_method.headers["Allow"] == "POST"


def oversized_body() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "x" * MAX_BODY, "max_tokens": 2}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_body_over_max_message_bytes_is_413(
    client: openai.OpenAI, cluster: LocalCluster, path: str
) -> None:
    url = f"{cluster.http_url}{path}"
    declared = httpx.post(url, json=oversized_body(), headers=AUTH)
    content = httpx.Request("POST", url, json=oversized_body()).content
    pieces = (content[i : i + 4096] for i in range(0, len(content), 4096))
    chunked = httpx.post(url, content=pieces, headers=AUTH | {"Content-Type": "application/json"})
    for response in (declared, chunked):
        assert response.status_code == 413, response.text
        if path == "/v1/messages":
            assert response.json()["error"]["type"] == "request_too_large"
            assert "router.max_message_bytes" in response.json()["error"]["message"]
        else:
            assert_openai_error(response, 413, "router.max_message_bytes")
    assert "content-length" not in chunked.request.headers
    assert_still_serving(client, cluster)


def one_connection(cluster: LocalCluster) -> http.client.HTTPConnection:
    host, port = cluster.http_url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_refused_body_is_dropped_and_its_connection_serves_on(
    cluster: LocalCluster, chunked: bool
) -> None:
    """The 413 keeps the connection (closing it with the body unread let the kernel's reset
    overtake the answer: the SDK saw a connection error); the whole body is sent, the rest of
    it is read and dropped, and the next request on the same socket is served."""
    body = json.dumps(oversized_body()).encode()
    content = (body[i : i + 4096] for i in range(0, len(body), 4096)) if chunked else body
    headers = AUTH | {"Content-Type": "application/json"}
    conn = one_connection(cluster)
    try:
        conn.request("POST", "/v1/completions", content, headers, encode_chunked=chunked)
        refused = conn.getresponse()
        error = json.loads(refused.read())["error"]
        assert refused.status == 413 and "router.max_message_bytes" in error["message"]
        assert refused.getheader("Content-Length") is not None and not refused.will_close
        sock = conn.sock
        good = json.dumps({"model": MODEL, "prompt": "same socket?", "max_tokens": 2})
        conn.request("POST", "/v1/completions", good, headers)
        served = conn.getresponse()
        assert served.status == 200, served.read()
        assert json.loads(served.read())["choices"][0]["finish_reason"] in ("stop", "length")
        assert conn.sock is sock  # not reopened: the first connection served both
    finally:
        conn.close()


def answer_then_close(cluster: LocalCluster, head: dict[str, str], sent: bytes) -> bytes:
    """Send a POST's headers and `sent` of its body, no more; all the server writes until it
    closes the connection."""
    host, port = cluster.http_url.removeprefix("http://").split(":")
    lines = ["POST /v1/completions HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in head.items())]
    received = b""
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + sent)
        while part := sock.recv(65536):
            received += part
    return received


@pytest.mark.parametrize(
    ("head", "sent"),
    [
        ({"Content-Length": str(DISCARD_BYTES + 1)}, b""),
        ({"Content-Length": str(MAX_BODY + 1), "Expect": "100-continue"}, b""),
        ({"Content-Length": str(MAX_BODY + 1)}, b"x" * 1000),
    ],
    ids=["declared past what is worth reading", "waits for 100 Continue", "stalls mid-body"],
)
def test_a_refused_body_the_server_cannot_read_to_its_end_is_answered_and_closed(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, head: dict[str, str], sent: bytes
) -> None:
    """Declared over DISCARD_BYTES, or held back for a `100 Continue` (never sent), or stalled
    past DISCARD_GAP_S: the 413 comes whole and says the connection closes, and it does."""
    monkeypatch.setattr(body_limit, "DISCARD_GAP_S", 0.3)
    began = time.monotonic()
    received = answer_then_close(cluster, AUTH | head, sent)
    assert time.monotonic() - began < 10
    status, _, rest = received.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large", received  # no 100 Continue first
    headers, _, content = rest.partition(b"\r\n\r\n")
    assert b"connection: close" in headers.lower()
    assert b"router.max_message_bytes" in json.loads(content)["error"]["message"].encode()


def test_a_prompt_over_max_prompt_chars_is_413(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    long = "word " * (MAX_PROMPT_CHARS // 5 + 1)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model=MODEL, prompt=long, max_tokens=2)
    error = assert_openai_error(err.value.response, 413, "max_prompt_chars")
    assert error["param"] == "prompt"
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=2
        )
    assert assert_openai_error(err.value.response, 413, "max_prompt_chars")["param"] == "messages"
    url = cluster.http_url
    tokenize = httpx.post(f"{url}/tokenize", json={"prompt": long}, headers=AUTH)
    assert_openai_error(tokenize, 413, "max_prompt_chars")
    counted = {"model": MODEL, "messages": [{"role": "user", "content": long}]}
    for path, body in [
        ("/v1/messages", counted | {"max_tokens": 2}),
        ("/v1/messages/count_tokens", counted),
    ]:
        response = httpx.post(f"{url}{path}", json=body, headers=AUTH)
        assert response.status_code == 413, response.text
        assert response.json()["error"]["type"] == "request_too_large"
    assert_still_serving(client, cluster)


def test_a_client_gone_while_sending_its_body_is_499_not_400(cluster: LocalCluster) -> None:
    """Half a declared body, then the socket closes: counted as a client gone (499), as one
    that leaves mid-stream is, not as a bad request."""
    counts = cluster.service.counters.http_responses
    before = dict(counts)
    host, port = cluster.http_url.removeprefix("http://").split(":")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Authorization: Bearer token-any\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"model": "tiny", "pro')
    deadline = time.monotonic() + 10
    while counts.get(("/v1/completions", 499), 0) == before.get(("/v1/completions", 499), 0):
        assert time.monotonic() < deadline, dict(counts)
        time.sleep(0.05)
    assert counts.get(("/v1/completions", 400), 0) == before.get(("/v1/completions", 400), 0)


def test_answers_are_counted_by_route_and_status(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    counts = cluster.service.counters.http_responses
    before = dict(counts)
    url = cluster.http_url
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=AUTH)
    httpx.get(f"{url}/v1/models")
    httpx.get(f"{url}/no/such/path", headers=AUTH)
    httpx.post(f"{url}/v1/completions", json=oversized_body(), headers=AUTH)
    count_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    httpx.post(f"{url}/v1/messages/count_tokens", json=count_body, headers=AUTH)
    httpx.get(f"{url}/health")
    for made_up in ("resp_1", "resp_2"):  # ids a client makes up are not labels
        httpx.get(f"{url}/v1/responses/{made_up}", headers=AUTH)
        httpx.get(f"{url}/v1/responses/{made_up}/input_items", headers=AUTH)
        httpx.get(f"{url}/v1/responses/{made_up}/more", headers=AUTH)
        httpx.get(f"{url}/v1/chat/completions/chatcmpl-{made_up}", headers=AUTH)
        httpx.get(f"{url}/v1/chat/completions/chatcmpl-{made_up}/messages", headers=AUTH)
    added = {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}
    assert added == {
        ("/v1/completions", 200): 1,
        ("/v1/chat/completions", 400): 1,
        ("/v1/models", 401): 1,
        ("/v1/completions", 413): 1,
        ("/v1/messages/count_tokens", 200): 1,
        ("/health", 200): 1,
        ("/v1/responses/{id}", 404): 2,
        ("/v1/responses/{id}/input_items", 404): 2,
        ("/v1/chat/completions/{id}", 404): 2,
        ("/v1/chat/completions/{id}/messages", 404): 2,
        ("other", 404): 3,
    }
    registry = CollectorRegistry()
    registry.register(RouterCollector(cluster.service))
    scraped = generate_latest(registry).decode()
    host_rate = cluster.service.timing.model.rates().host_rate
    assert f"radixmesh_router_learned_host_tokens_per_second {host_rate}" in scraped
    for (route, status), count in counts.items():
        line = f'radixmesh_router_http_responses_total{{route="{route}",status="{status}"}}'
        assert f"{line} {float(count)}" in scraped, scraped
