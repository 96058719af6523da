"""Suite-wide settings: `gpu` tests skip without CUDA; hypothesis profiles for CI and local; the
tiny random model that engine and cluster tests serve."""

from __future__ import annotations

import os
from typing import Any

# Before anything imports torch: OpenMP threads that spin while waiting make every small torch op
# on a 2-core machine many times slower (a 0.05 s test took 6.4 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Decode steps stay eager unless a test compiles them itself (worker/decode_graph.py: a compile
# takes tens of seconds of CPU, in a thread of its own, and writes a package to a cache).
os.environ.setdefault("RADIXMESH_COMPILED_DECODE", "0")

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The built-in tiny checkpoint, written to disk and loaded like any model (a LoadedModel;
    engines only read it, so the whole session shares one). Imported here, not at the top: the
    cache tests load neither torch nor the worker."""
    from worker.loader import load_model
    from worker.tiny_model import build_tiny_checkpoint

    return load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def thinking(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny checkpoint as a thinking model: its chat template opens `<think>` for the model
    (tests/worker/thinking_fixtures.py)."""
    from tests.worker.thinking_fixtures import thinking_model

    return thinking_model(tiny, tmp_path_factory.mktemp("thinking") / "model")
