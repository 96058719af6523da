"""The routing policy a router actor uses, built by name from the cluster configuration."""

from __future__ import annotations

import time

from cluster.config import ClusterConfig
from router.config import RouterConfig
from router.interface import RoutingPolicy
from router.policies import make_policy


def build_policy(config: ClusterConfig) -> RoutingPolicy:
    """`config.router.policy` over routing blocks of the workers' block size (one config, so
    router and workers agree by construction); raises UnknownPolicy naming the known ones."""
    router_config = RouterConfig(block_tokens=config.engine.block_size)
    return make_policy(config.router.policy, router_config, time.monotonic)
