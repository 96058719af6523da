"""The config file is refused at load, naming the key, for values the cluster cannot run with."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # range(max_retries + 1) is empty below 0: every request ended OK with no token
        ("router: {max_retries: -1}", "router.max_retries: must be at least 0, got -1"),
        ("router: {max_in_flight: 0}", "router.max_in_flight: must be at least 1, got 0"),
        ("router: {port: 70000}", "router.port: must be from 0 to 65535, got 70000"),
        ("router: {policy: fastest}", "router.policy: 'fastest' is not one of ['cache_aware'"),
        ("model: {device: gpu}", "model.device: 'gpu' is not one of ['auto', 'cpu', 'cuda']"),
        ("model: {dtype: fp8}", "model.dtype: 'fp8' is not one of"),
        ("workers: {count: 0}", "workers.count: must be at least 1, got 0"),
        ("workers: {cpus_per_worker: -1}", "workers.cpus_per_worker: must be at least 0"),
        ("engine: {num_pages: 0}", "engine.num_pages: must be at least 1, got 0"),
        ("metrics: {worker_port: -1}", "metrics.worker_port: must be from 0 to 65535"),
        ("drain_timeout_s: -5", "drain_timeout_s: must be at least 0, got -5.0"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_its_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        ClusterConfig.load(path)
    assert str(err.value).startswith(f"{path}.") and expected in str(err.value)


def test_the_edges_of_each_range_load(tmp_path: Path) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(
        "model: {device: cuda, dtype: null}\n"
        "engine: {max_model_len: null, max_waiting: 0}\n"
        "workers: {count: null, max_restarts: -1, cpus_per_worker: 0.5}\n"
        "router: {port: 0, max_retries: 0, max_in_flight: 1, policy: round_robin}\n"
        "metrics: {router_port: 65535, worker_port: 0}\n"
        "drain_timeout_s: 0\n"
    )
    config = ClusterConfig.load(path)
    assert (config.router.port, config.router.max_retries, config.router.policy) == (
        0, 0, "round_robin",
    )  # fmt: skip
    assert config.engine.max_model_len is None and config.workers.count is None
