"""The routing policy a router actor uses, built by name from the cluster configuration."""

from __future__ import annotations

import time

from cluster.config import ClusterConfig
from router.config import RouterConfig
from router.interface import RoutingPolicy
from router.policies import make_policy


def router_config(config: ClusterConfig) -> RouterConfig:
    """What every policy of this cluster is built with: routing blocks of the workers' block size
    (one config, so router and workers agree by construction) and the default prefill rate,
    which the router's stream timing also starts from (cluster/stream_timing.py)."""
    router = config.router
    reads = router.peer_kv_min_tokens and router.peer_kv_rate
    return RouterConfig(
        block_tokens=config.engine.block_size,
        peer_rate=router.peer_kv_rate if reads else None,
        peer_min_tokens=max(1, router.peer_kv_min_tokens),
    )


def build_policy(config: ClusterConfig) -> RoutingPolicy:
    """`config.router.policy` over `router_config(config)`; raises UnknownPolicy naming the
    known ones."""
    return make_policy(config.router.policy, router_config(config), time.monotonic)
