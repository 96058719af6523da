"""`--chaos`: kill a worker actor or the router at a given time of a run, and account for it.

The kill goes through Ray (the actors are named `radixmesh-<worker>` / `radixmesh-router` in
namespace `radixmesh`) from a short subprocess with Ray's environment (so this process needs no
Ray). Ray restarts the actor; the report (report.json and summary.md) says what happened to the
requests in flight at the kill, when the first request sent after it succeeded, when every
worker was healthy again, how many requests the clients saw fail (and how many of those had
streamed tokens first: truncated streams), and whether the cluster recovered: every worker
healthy again and, if requests were sent after the kill, one of them served. A run whose cluster
did not recover exits non-zero (cluster/loadtest/cli.py).

A kill is never made once the run's requests are done: the report then says the run ended
first. A kill that fails (no such actor, Ray unreachable) is recorded with its reason, and the
run goes on undisturbed. The wait for recovery ends at the run's `--max-seconds`, and at most
`RECOVERY_LIMIT_S` after the kill.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cluster.loadtest.records import RequestRecord

KILL = """
import cluster  # Ray's environment first (loopback, token mode)
import ray
from cluster.ray_runtime import NAMESPACE
ray.init(address={address!r}, namespace=NAMESPACE, logging_level="ERROR")
ray.kill(ray.get_actor({actor!r}), no_restart=False)
"""
KILL_TIMEOUT_S = 120.0
RECOVERY_LIMIT_S = 300.0
TARGET = re.compile(r"router|worker-[0-9]+")

KILLED, KILL_FAILED, RUN_ENDED_FIRST = "killed", "kill_failed", "run_ended_first"


@dataclass(frozen=True)
class ChaosPlan:
    target: str
    """"router" or a worker name ("worker-0")."""
    at_s: float
    ray_address: str

    @classmethod
    def parse(cls, text: str, ray_address: str | None) -> ChaosPlan:
        """`TARGET@SECONDS`; ValueError, naming what is wrong, for anything else."""
        target, at_sign, at = text.partition("@")
        if not at_sign or not TARGET.fullmatch(target):
            raise ValueError(
                f"--chaos wants TARGET@SECONDS, TARGET being router or worker-<N> "
                f"(router@10, worker-0@10), got {text!r}"
            )
        try:
            seconds = float(at)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"--chaos: the time {at!r} is not a number of seconds >= 0")
        address = ray_address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise ValueError(
                "--chaos needs the cluster's Ray address (--ray-address or RAY_ADDRESS)"
            )
        return cls(target, seconds, address)

    def kill(self) -> None:
        """Kill the actor (Ray restarts it); CalledProcessError or TimeoutExpired if it fails."""
        code = KILL.format(address=self.ray_address, actor=f"radixmesh-{self.target}")
        env = {**os.environ, "RAY_ADDRESS": self.ray_address}
        subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            check=True,
            timeout=KILL_TIMEOUT_S,
            capture_output=True,
        )


@dataclass
class ChaosEvent:
    """What became of a plan during a run."""

    attempted_at: float | None = None
    """Seconds into the run when the kill was made; None while (or if) it never was."""
    error: str | None = None
    """Why the kill failed; None if it succeeded (or was never made)."""
    done_at: float | None = None
    """Seconds into the run when the kill call returned (the actor died between the two)."""
    whole_again_s: float | None = None
    """From the kill until every worker was healthy again; None if not seen."""


def failure(err: BaseException) -> str:
    """One line on why the kill subprocess failed."""
    if isinstance(err, subprocess.TimeoutExpired):
        return f"the kill did not finish within {err.timeout:g} s"
    if isinstance(err, subprocess.CalledProcessError):
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else ""
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        return lines[-1] if lines else f"the kill exited with status {err.returncode}"
    return str(err)


async def watch(
    plan: ChaosPlan,
    event: ChaosEvent,
    healthy_workers: Callable[[], Awaitable[int]],
    now: Callable[[], float],
    deadline_s: float,
) -> None:
    """Wait until `plan.at_s`, kill, then poll `healthy_workers` (the run's API: GetStats, or
    GET /health; -1 when the router does not answer) until the cluster has its workers back, no
    later than `deadline_s` into the run (and `RECOVERY_LIMIT_S` after the kill). The run
    cancels this while `event.attempted_at` is None, once its requests are done."""
    await asyncio.sleep(max(0.0, plan.at_s - now()))
    before = await healthy_workers()
    whole = before if before > 0 else 1  # not known (the probe failed): one worker back will do
    killed_at = event.attempted_at = now()
    try:
        await asyncio.to_thread(plan.kill)
    except (subprocess.SubprocessError, OSError) as err:
        event.error = failure(err)
        return
    event.done_at = now()
    until = min(deadline_s, killed_at + RECOVERY_LIMIT_S)
    while now() < until:
        await asyncio.sleep(min(0.5, max(0.0, until - now())))
        if await healthy_workers() >= whole:
            event.whole_again_s = now() - killed_at
            return


def account(
    records: list[RequestRecord], event: ChaosEvent, plan: ChaosPlan, ended_at: float
) -> dict[str, Any]:
    """report.json's `chaos` object. The request counts are null unless the kill happened."""
    report: dict[str, Any] = {
        "target": plan.target,
        "planned_at_s": plan.at_s,
        "outcome": KILLED,
        "at_s": event.attempted_at,
        "kill_returned_at_s": event.done_at,
        "error": event.error,
        "requests_ended_at_s": ended_at,
        "in_flight": None,
        "in_flight_outcomes": None,
        "recovery_s": None,
        "all_workers_healthy_after_s": None,
        "errors": sum(1 for r in records if not r.ok),
        "truncated": sum(1 for r in records if not r.ok and r.output_tokens > 0),
        "recovered": None,
    }
    killed_at = event.attempted_at
    if killed_at is None:
        return {**report, "outcome": RUN_ENDED_FIRST}
    if event.error is not None:
        return {**report, "outcome": KILL_FAILED}
    # the actor died somewhere between the kill call and its return (its subprocess first joins
    # Ray, most of a second): a request sent in between was in flight through the dying actor
    died_by = event.done_at if event.done_at is not None else killed_at
    in_flight = [r for r in records if r.start <= died_by and (r.end or 0) >= killed_at]
    outcomes: dict[str, int] = {}
    for r in in_flight:
        key = "completed" if r.ok else r.status
        outcomes[key] = outcomes.get(key, 0) + 1
    sent_after = [r for r in records if r.start > died_by]
    after = sorted((r for r in sent_after if r.ok), key=lambda r: r.end or 0)
    return {
        **report,
        "in_flight": len(in_flight),
        "in_flight_outcomes": outcomes,
        "recovery_s": (after[0].end - killed_at) if after and after[0].end else None,
        "all_workers_healthy_after_s": event.whole_again_s,
        "recovered": event.whole_again_s is not None and (bool(after) or not sent_after),
    }
