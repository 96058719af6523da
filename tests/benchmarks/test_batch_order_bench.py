"""The batch order benchmark on the tiny model with small counts: a JSON line per run and the
table; the prefix order computes fewer of the batch's prompt tokens than the file's (no timing
is asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import batch_order_bench
from benchmarks.batch_order_bench import batch_lines, documents


def test_the_prefix_order_computes_less_than_the_files(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tiny", "--rounds", "1", "--documents", "16", "--questions", "3"]
    assert batch_order_bench.main([*argv, "--document-chars", "400"]) == 0
    captured = capsys.readouterr()
    reports = {r["order"]: r for r in map(json.loads, captured.out.splitlines())}
    assert set(reports) == {"file", "prefix"}
    for report in reports.values():
        assert report["requests"] == 48
        assert report["computed_tokens"] == report["prompt_tokens"] - report["cached_tokens"]
    assert reports["prefix"]["prompt_tokens"] == reports["file"]["prompt_tokens"]
    assert reports["prefix"]["computed_tokens"] < reports["file"]["computed_tokens"]
    assert "batch order: median" in captured.err


def test_the_batch_asks_each_document_its_questions_shuffled() -> None:
    docs = documents(5, 300)
    assert len(set(docs)) == 5 and all(len(d) == 300 for d in docs)
    lines = [json.loads(x) for x in batch_lines(docs, 3, seed=1, max_tokens=4)]
    ids = [x["custom_id"] for x in lines]
    assert sorted(ids) == sorted(f"d{d}-q{q}" for d in range(5) for q in range(3))
    assert ids != sorted(ids, key=lambda i: (int(i[1 : i.index("-")]), i))  # shuffled
    assert all(x["url"] == "/v1/chat/completions" and x["method"] == "POST" for x in lines)
