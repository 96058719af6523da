"""Joining Ray: the cluster at RAY_ADDRESS (e.g. inside `ray job submit`), or an embedded one.

The embedded cluster binds 127.0.0.1 only (cluster/__init__.py sets the environment Ray needs
for that before any module of ours imports ray). Ray turns token authentication on for it; its
token is the one the user configured or, when none is, a fresh one of this process
(cluster/ray_token.py), never one Ray would write to ~/.ray/auth_token.
"""

from __future__ import annotations

import logging
import os

import ray

from cluster.ray_token import embedded_cluster_token

NAMESPACE = "radixmesh"
"""Ray namespace of the cluster's named actors (radixmesh-router, radixmesh-worker-N)."""


def actor_name(name: str) -> str:
    """The Ray name of the cluster's actor `name` ("router", "worker-0", ...)."""
    return f"radixmesh-{name}"


def connect(num_cpus: int | None = None) -> bool:
    """Connect to Ray; True when this call started an embedded cluster (the caller stops it)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        return False
    embedded_cluster_token()
    ray.init(
        # "local": always a new cluster. Without it Ray first tries the address in
        # <tmp>/ray/ray_current_cluster, and a cluster killed without `ray stop` leaves that file
        # behind: serve then waited forever on a GCS that was gone.
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=NAMESPACE,
        _node_ip_address="127.0.0.1",
        logging_level=logging.WARNING,
    )
    return True


def gpu_count() -> int:
    return int(ray.cluster_resources().get("GPU", 0))
