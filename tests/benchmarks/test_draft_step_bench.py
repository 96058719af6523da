"""The drafted-step benchmark on the CPU with the tiny model: its oracle's kept drafts yield
k + 1 tokens a step and its rejected ones 1, the oracle is removed after each run, and the
JSON and table are whole (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import draft_step_bench
from benchmarks.draft_step_bench import Oracle
from worker.speculation import NgramIndex


def test_kept_drafts_yield_k_plus_one_tokens_a_step_and_rejected_ones_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    original = NgramIndex.propose
    argv = ["--device", "cpu", "--weights", "float32", "--batches", "1", "3", "--k", "2", "5"]
    assert draft_step_bench.main([*argv, "--steps", "4"]) == 0
    assert NgramIndex.propose is original
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["batch"], r["k"], r["drafts"]) for r in rows] == [
        (batch, k, mode)
        for batch in (1, 3)
        for k, mode in ((0, "-"), (2, "kept"), (2, "rejected"), (5, "kept"), (5, "rejected"))
    ]
    for r in rows:
        expected = r["k"] + 1 if r["drafts"] == "kept" else 1
        assert r["tokens_per_step"] == pytest.approx(expected), r
        assert r["step_ms"] > 0 and r["ratio"] > 0


def test_the_oracle_reads_the_continuation_from_the_tokens_generated_so_far() -> None:
    prompt = tuple(range(10, 10 + draft_step_bench.CONTEXT))
    oracle = Oracle({prompt: [5, 6, 7, 8]}, shift=1, vocab=8)
    assert oracle.propose([*prompt, 5], 2) == [7, 0]  # 6 + 1, (7 + 1) mod 8
    assert oracle.propose([*prompt, 5, 6, 7], 5) == [1]  # only what is left
