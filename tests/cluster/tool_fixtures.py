"""What the HTTP tests of tools, structured outputs and the Responses API share: a local
cluster of two tiny-model workers with room for the tools' description, an OpenAI client of
it, and tools whose every value a random model can write (enums, bounded integers), so a call
either completes or is cut by max_tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import openai

from tests.cluster.local_cluster import ENGINE, LocalCluster, start_cluster
from worker.loader import LoadedModel

LONG_CONTEXT = replace(ENGINE, num_pages=1024, max_model_len=1024)
"""The tools' description takes ~700 of the tiny byte-level vocabulary's tokens."""


def served(loaded: LoadedModel, engine: Any = LONG_CONTEXT) -> Iterator[LocalCluster]:
    """A module fixture's body: the cluster with the HTTP API, closed after."""
    cluster = start_cluster(loaded, http=True, engine=engine)
    try:
        yield cluster
    finally:
        cluster.close()


def openai_client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
