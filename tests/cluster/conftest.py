"""Fixtures the cluster tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.local_cluster import LocalCluster, start_cluster
from worker.loader import LoadedModel


@pytest.fixture(scope="module")
def thinking_cluster(thinking: LoadedModel) -> Iterator[LocalCluster]:
    """One worker of the thinking model, with the HTTP API; a module's own."""
    running = start_cluster(thinking, workers=1, http=True)
    yield running
    running.close()
