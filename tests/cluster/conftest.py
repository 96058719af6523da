"""Fixtures the cluster tests share."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.cluster.local_cluster import LocalCluster, start_cluster
from tests.cluster.tool_fixtures import openai_client, served
from worker.loader import LoadedModel


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    """Two tiny-model workers with the HTTP API and a long context (tool_fixtures.served); one
    per test module. A module that needs another cluster defines its own `cluster`."""
    yield from served(tiny)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    """The `openai` SDK on the module's `cluster`."""
    yield from openai_client(cluster)


@pytest.fixture(scope="module")
def thinking_cluster(thinking: LoadedModel) -> Iterator[LocalCluster]:
    """One worker of the thinking model, with the HTTP API; a module's own."""
    running = start_cluster(thinking, workers=1, http=True)
    yield running
    running.close()
