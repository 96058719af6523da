"""The routing policy a router actor uses, built by name from the cluster configuration."""

from __future__ import annotations

import time

from cluster.config import ClusterConfig
from router.config import RouterConfig
from router.interface import RoutingPolicy
from router.round_robin import RoundRobin


def build_policy(config: ClusterConfig) -> RoutingPolicy:
    router_config = RouterConfig(block_tokens=config.engine.block_size)
    policy: RoutingPolicy = RoundRobin(router_config, time.monotonic)
    return policy
