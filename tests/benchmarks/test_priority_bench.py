"""The priority benchmark on the tiny model with small counts: each run serves every interactive
request, keeps its batch load, and only the priority run preempts (no timing is asserted)."""

from __future__ import annotations

import argparse

from rich.progress import Progress

from benchmarks.priority_bench import PolicyRun, Run, table
from worker.loader import LoadedModel


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        interactive=4, rate=50.0, batch=6, max_running=2, pages=256, warmup=0.2,
        timeout=120.0, seed=3,
    )  # fmt: skip


def test_both_policies_serve_every_request_and_only_priority_preempts(tiny: LoadedModel) -> None:
    runs: dict[str, Run] = {}
    with Progress(disable=True) as progress:
        for policy in ("fcfs", "priority"):
            runs[policy] = PolicyRun(tiny, policy, _args())(progress)
    for run in runs.values():
        assert sorted(run.first) == sorted(run.ended) == sorted(run.submitted)
        assert len(run.submitted) == 4 and run.batch_tokens > 0
        assert all(run.submitted[r] <= run.first[r] <= run.ended[r] for r in run.submitted)
    assert runs["fcfs"].preemptions == 0
    assert runs["priority"].preemptions > 0  # 6 batch requests hold both running slots
    reports = [run.report() for run in runs.values()]
    assert {r["policy"] for r in reports} == {"fcfs", "priority"}
    assert table(reports, rounds=1).row_count == 2


def test_a_request_id_makes_the_same_prompt_in_every_run(tiny: LoadedModel) -> None:
    one, two = PolicyRun(tiny, "fcfs", _args()), PolicyRun(tiny, "priority", _args())
    assert (
        one.request("b3", 20, 4, 0).prompt_token_ids == two.request("b3", 20, 4, 1).prompt_token_ids
    )
    assert (
        one.request("b3", 20, 4, 0).prompt_token_ids != one.request("b4", 20, 4, 0).prompt_token_ids
    )
