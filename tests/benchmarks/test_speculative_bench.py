"""The speculative decoding benchmark on the tiny model with small counts: every run finishes
its chats, the answers with drafts equal those without, and the report and table are whole (no
timing is asserted)."""

from __future__ import annotations

import argparse

from rich.progress import Progress

from benchmarks.speculative_bench import (
    FUNCTION,
    WORKLOADS,
    SpeculationRun,
    prediction,
    same_answers,
    table,
    workload,
)
from worker.loader import LoadedModel


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        requests=3, concurrency=2, max_tokens=24, pages=256, timeout=120.0, prediction_tokens=16
    )


def test_every_run_answers_each_chat_as_the_run_without_drafts(tiny: LoadedModel) -> None:
    runs = []
    with Progress(disable=True) as progress:
        for k in (0, 3, 0):
            runs.append(SpeculationRun(tiny, "edit", k, _args())(progress))
    for run in runs:
        assert sorted(run.ended) == sorted(run.submitted) == [f"edit-{i}" for i in range(3)]
        assert all(len(tokens) == 24 for tokens in run.tokens.values())  # no EOS in 24 here
    assert same_answers(runs) == [True, True, True]
    runs[2].tokens["edit-1"] = runs[2].tokens["edit-1"][:-1]
    assert same_answers(runs) == [True, True, False]
    assert runs[1].draft_tokens >= runs[1].accepted_draft_tokens > 0 == runs[0].draft_tokens
    reports = [run.report() | {"same_as_k0": True} for run in runs]
    assert reports[1]["k"] == 3 and reports[1]["output_tokens"] == 72
    assert table(reports, rounds=1).row_count == 2  # (edit, 0) and (edit, 3)


def test_the_workloads_are_chats_that_differ_by_request() -> None:
    for name in WORKLOADS:
        first, second = workload(name, 0), workload(name, 1)
        assert first[0]["role"] == "user" and first != second
    assert "```python" in workload("edit", 0)[0]["content"]


def test_a_run_with_predictions_answers_as_the_run_without(tiny: LoadedModel) -> None:
    runs = []
    with Progress(disable=True) as progress:
        for k, predicted in ((0, False), (0, True), (3, True)):
            run = SpeculationRun(tiny, "repeat", k, _args(), predicted)
            asked = [run.sampling(i).prediction for i in range(3)]
            assert asked == ([prediction("repeat", i) for i in range(3)] if predicted else [""] * 3)
            runs.append(run(progress))
    assert same_answers(runs) == [True, True, True]
    reports = [run.report() | {"same_as_k0": True} for run in runs]
    assert [r["prediction"] for r in reports] == [False, True, True]
    assert reports[0]["accepted_prediction_tokens"] == reports[0]["rejected_prediction_tokens"] == 0
    assert table(reports, rounds=1).row_count == 3
    assert prediction("free", 0) == ""
    assert prediction("repeat", 1) in workload("repeat", 1)[0]["content"]
    assert FUNCTION in prediction("edit", 2)
    stale, paragraph = prediction("stale", 1).split(" "), prediction("repeat", 1).split(" ")
    assert len(stale) == len(paragraph) and stale != paragraph
    assert workload("stale", 1) == workload("repeat", 1)
