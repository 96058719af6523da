"""`--chaos`: kill a worker actor or the router at a given time of a run, and account for it.

The kill goes through Ray (the actors are named `radixmesh-<worker>` / `radixmesh-router` in
namespace `radixmesh`) from a short subprocess with Ray's environment (so this process needs no
Ray). Ray restarts the actor; the report says what happened to the requests in flight at the
kill, when the first request sent after it succeeded, and when every worker was healthy again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from cluster.loadtest.records import RequestRecord
from cluster.ray_runtime import NAMESPACE

KILL = """
import cluster  # Ray's environment first (loopback, token mode)
import ray
ray.init(address={address!r}, namespace={namespace!r}, logging_level="ERROR")
ray.kill(ray.get_actor({actor!r}), no_restart=False)
"""


@dataclass(frozen=True)
class ChaosPlan:
    target: str
    """"router" or a worker name ("worker-0")."""
    at_s: float
    ray_address: str

    @classmethod
    def parse(cls, text: str, ray_address: str | None) -> ChaosPlan:
        target, _, at = text.partition("@")
        address = ray_address or os.environ.get("RAY_ADDRESS")
        if not target or not at:
            raise ValueError(f"--chaos wants TARGET@SECONDS (router@10, worker-0@10), got {text!r}")
        if not address:
            raise ValueError(
                "--chaos needs the cluster's Ray address (--ray-address or RAY_ADDRESS)"
            )
        return cls(target, float(at), address)

    def kill(self) -> None:
        code = KILL.format(
            address=self.ray_address, namespace=NAMESPACE, actor=f"radixmesh-{self.target}"
        )
        env = {**os.environ, "RAY_ADDRESS": self.ray_address}
        subprocess.run(
            [sys.executable, "-c", code], env=env, check=True, timeout=120, capture_output=True
        )


async def healthy_count(stub: Any, metadata: list[tuple[str, str]]) -> int:
    from protos.radixmesh.v1 import serving_pb2  # noqa: PLC0415

    try:
        stats = await stub.GetStats(serving_pb2.GetStatsRequest(), metadata=metadata, timeout=2)
    except Exception:  # the router itself may be the one restarting
        return -1
    return sum(1 for w in stats.workers if w.healthy)


def account(
    records: list[RequestRecord], killed_at: float, whole_again_s: float | None, plan: ChaosPlan
) -> dict[str, Any]:
    in_flight = [r for r in records if r.start <= killed_at and (r.end or 0) >= killed_at]
    outcomes: dict[str, int] = {}
    for r in in_flight:
        key = "completed" if r.ok else r.status
        outcomes[key] = outcomes.get(key, 0) + 1
    after = sorted((r for r in records if r.start > killed_at and r.ok), key=lambda r: r.end or 0)
    return {
        "target": plan.target,
        "at_s": killed_at,
        "in_flight": len(in_flight),
        "in_flight_outcomes": outcomes,
        "recovery_s": (after[0].end - killed_at) if after and after[0].end else None,
        "all_workers_healthy_after_s": whole_again_s,
    }


async def watch(
    plan: ChaosPlan, stub: Any, metadata: list[tuple[str, str]], now: Any
) -> tuple[float, float | None]:
    """Wait until `plan.at_s`, kill, then poll until the cluster has its workers back."""
    await asyncio.sleep(max(0.0, plan.at_s - now()))
    before = await healthy_count(stub, metadata)
    killed_at = now()
    await asyncio.to_thread(plan.kill)
    for _ in range(600):
        await asyncio.sleep(0.5)
        if await healthy_count(stub, metadata) >= before > 0:
            return killed_at, now() - killed_at
    return killed_at, None
