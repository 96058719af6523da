"""The registry of routing policies: name -> constructor. `cache_aware` is the default.

Every constructor takes (config, clock) and its own keyword knobs; `make_policy` builds one by
name and raises `UnknownPolicy` naming the known ones. Must never build a policy from a
name it does not list (no fallback to a default on a typo).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from router.base import BaseRouter, Clock
from router.cache_aware import CacheAware
from router.config import RouterConfig
from router.consistent_hash import ConsistentHash
from router.errors import UnknownPolicy
from router.least_load import LeastLoad
from router.least_ttft import LeastTtft
from router.round_robin import RoundRobin
from router.sglang import SglangApproxTree

DEFAULT_POLICY = "cache_aware"

POLICIES: dict[str, Callable[..., BaseRouter]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "consistent_hash": ConsistentHash,
    "sglang": SglangApproxTree,
    "least_ttft": LeastTtft,
    "cache_aware": CacheAware,
}


def make_policy(
    name: str = DEFAULT_POLICY,
    config: RouterConfig | None = None,
    clock: Clock = time.monotonic,
    **knobs: object,
) -> BaseRouter:
    """A new policy `name` over `config`, reading time from `clock` (seconds)."""
    constructor = POLICIES.get(name)
    if constructor is None:
        raise UnknownPolicy(name, sorted(POLICIES))
    return constructor(config, clock, **knobs)
