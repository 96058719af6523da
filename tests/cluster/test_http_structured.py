"""Structured outputs through the OpenAI API, with the `openai` SDK as applications call it
(`response_format`, `chat.completions.parse` with a pydantic model, vLLM's fields in
extra_body), over real HTTP on loopback to a local cluster of two tiny-model workers. The
weights are random: whatever structure the answers have, the grammar gave them."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
from pydantic import BaseModel, Field

from tests.cluster.local_cluster import SERVED_NAME, LocalCluster

MODEL = SERVED_NAME
CHAT = [{"role": "user", "content": "Describe a cache tier as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "tier": {"enum": ["device", "host", "disk"]},
        "pages": {"type": "integer", "minimum": 0, "maximum": 99},
        "warm": {"type": "boolean"},
    },
    "required": ["tier", "pages", "warm"],
    "additionalProperties": False,
}


class Tier(BaseModel):
    tier: Literal["device", "host", "disk"]
    pages: int = Field(ge=0, le=99)
    label: str = Field(max_length=5)


def test_response_format_json_schema_holds_for_every_choice(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "tier", "schema": SCHEMA, "strict": True},
        },
    )
    values = []
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        assert choice.message.content is not None
        value = json.loads(choice.message.content)
        jsonschema.validate(value, SCHEMA)
        values.append(value)
    assert len({json.dumps(v) for v in values}) > 1
    cluster.wait_idle()


def test_the_sdks_parse_helper_returns_the_pydantic_model(
    client: openai.OpenAI, cluster: LocalCluster
) -> None:
    """`chat.completions.parse` sends the model's strict JSON schema and parses the answer back
    into it: what an application using structured outputs does."""
    for seed in range(3):
        reply = client.chat.completions.parse(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            response_format=Tier,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, Tier), reply
        assert reply.choices[0].finish_reason == "stop"
    cluster.wait_idle()


def test_json_object_streamed_is_one_object(client: openai.OpenAI, cluster: LocalCluster) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=300,
        stream=True,
        response_format={"type": "json_object"},
    )
    text, reasons = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    if reasons[-1] == "stop":
        assert isinstance(json.loads(text), dict), text
    else:  # the greedy random model kept the object open past 300 tokens
        assert reasons[-1] == "length" and text.startswith("{")
    cluster.wait_idle()


def test_vllms_fields_on_both_apis(client: openai.OpenAI, cluster: LocalCluster) -> None:
    choices = ["red", "green", "blue"]
    text = client.completions.create(
        model=MODEL,
        prompt="The colour is",
        n=6,
        temperature=1.0,
        seed=1,
        max_tokens=10,
        extra_body={"guided_choice": choices},
    )
    assert {c.text for c in text.choices} <= set(choices)
    assert all(c.finish_reason == "stop" for c in text.choices)
    pattern = r"[0-9]{3}-[a-z]{2}"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        temperature=1.0,
        seed=2,
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    content = chat.choices[0].message.content
    assert content is not None and re.fullmatch(pattern, content), content
    grammar = 'root ::= "<" [a-c]+ ">"'
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=30,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    content = chat.choices[0].message.content
    assert content is not None and re.fullmatch(r"<[a-c]+>", content), content
    cluster.wait_idle()
    assert not cluster.service.in_flight
