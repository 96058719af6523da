"""Suite-wide settings: `gpu` tests skip without CUDA; hypothesis profiles for CI and local."""

from __future__ import annotations

import os

# Before anything imports torch: OpenMP threads that spin while waiting make every small torch op
# on a 2-core machine many times slower (a 0.05 s test took 6.4 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
