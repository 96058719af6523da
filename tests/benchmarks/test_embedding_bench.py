"""The embedding benchmark on the tiny model with small counts: a JSON line per run and a whole
table; the shared mode computes less of the contextual workload than the isolated one and
gives the same embeddings (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import embedding_bench
from benchmarks.embedding_bench import INSTRUCTION, WORKLOADS, workload


def test_shared_inputs_compute_less_and_embed_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--inputs", "6", "--latency-inputs", "2", "--rounds", "1"]
    assert embedding_bench.main([*argv, "--context-chars", "300"]) == 0
    captured = capsys.readouterr()
    reports = [json.loads(line) for line in captured.out.splitlines()]
    assert sorted((r["workload"], r["mode"]) for r in reports) == sorted(
        (w, m) for w in WORKLOADS for m in ("shared", "shared-nowait", "isolated")
    )
    by = {(r["workload"], r["mode"]): r for r in reports}
    assert (
        by["contextual", "shared"]["computed_tokens"]
        < by["contextual", "isolated"]["computed_tokens"]
    )
    assert (
        by["contextual", "isolated"]["computed_tokens"]
        == by["contextual", "isolated"]["prompt_tokens"]
    )
    assert all(r["largest_difference"] < 1e-5 and r["inputs"] == 6 for r in reports)
    assert "embeddings, median" in captured.err


def test_the_workloads_differ_by_input_and_share_what_they_say() -> None:
    queries, contextual, documents = (workload(name, 4, 300) for name in WORKLOADS)
    for inputs in (queries, contextual, documents):
        assert len(set(inputs)) == 4
    assert all(q.startswith(INSTRUCTION) for q in queries)
    context = contextual[0].split("</document>")[0]
    assert all(c.startswith(context) for c in contextual) and len(context) > 300
    assert not any(d.startswith(documents[0][:50]) for d in documents[1:])
