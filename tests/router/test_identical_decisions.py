"""Speed work on the router must not change a single decision: every routed request's worker
and predicted cached tokens, in dispatch order, and the simulator's report with its timings
removed, on slices of the Mooncake conversation trace, against a golden fixture recorded from
the code before the speed work (identical_decisions.json). It was re-recorded once, for block
identity version 2 (XXH3): new prefixes go to the rendezvous winner of their first block's hash,
so new hash values place them anew.

Regenerate the fixture only for an intended change of decisions:
`python -m tests.router.test_identical_decisions --write`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import router_sim, workloads
from router.interface import RouteDecision, RouteRequest

FIXTURE = Path(__file__).with_name("identical_decisions.json")
TIMINGS = {"decisions_per_s", "decision_p50_us", "decision_p99_us", "wall_s"}
CASES: dict[str, tuple[str, ...]] = {
    "8x2M": ("--limit", "3000"),
    "8x0.5M-delayed-events": (
        "--limit", "3000", "--capacity-tokens", "500000", "--event-delay-ms", "50",
    ),
    "24x1M-3-copies": ("--limit", "1000", "--copies", "3", "--workers", "24",
                       "--capacity-tokens", "1000000"),
}  # fmt: skip
"""Slices of the trace: the default cluster, a small one that evicts under late events, and
one with large match groups (more than `scan` members)."""


def fingerprint(*argv: str) -> dict[str, Any]:
    """cache_aware over a slice: the decisions' count and digest, and the report sans timings."""
    args = router_sim.parse_args(["--quiet", "--policy", "cache_aware", *argv])
    stream = router_sim.load_stream(args)
    pooled = router_sim.pooled_reference(stream, args)
    sim = router_sim.Simulation(stream, "cache_aware", args)
    decisions: list[tuple[str, str, int]] = []
    inner = sim.policy.route

    def recorded(request: RouteRequest) -> RouteDecision:
        decision = inner(request)
        decisions.append((request.request_id, decision.worker, decision.predicted_cached_tokens))
        return decision

    sim.policy.route = recorded  # type: ignore[method-assign]
    sim.run()
    row = {k: v for k, v in sim.result(pooled, 0.0).items() if k not in TIMINGS}
    digest = hashlib.sha256(json.dumps(decisions).encode()).hexdigest()
    return {"decisions": len(decisions), "sha256": digest, "row": row}


@pytest.mark.skipif(not workloads.MOONCAKE_TRACE.exists(), reason="Mooncake trace absent")
@pytest.mark.parametrize("case", sorted(CASES))
def test_decisions_identical_to_golden(case: str) -> None:
    golden = json.loads(FIXTURE.read_text())[case]
    got = json.loads(json.dumps(fingerprint(*CASES[case])))  # floats as the fixture holds them
    assert got["decisions"] == golden["decisions"]
    assert got["row"] == golden["row"]
    assert got["sha256"] == golden["sha256"], "a routing decision changed"


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    result = {case: fingerprint(*argv) for case, argv in sorted(CASES.items())}
    FIXTURE.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
