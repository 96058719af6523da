"""The cache benchmark's correctness properties (no timings are asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import workloads
from benchmarks.cache_bench import main, run_simple_trie

TRACE_ABSENT = not workloads.MOONCAKE_TRACE.exists()


def test_bench_prints_one_json_object_per_workload(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cache.jsonl"
    argv = ["--quick", "--quiet", "--no-memory", "--output", str(out)]
    assert main([*argv, "--workloads", "shared-prefix", "no-sharing"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["workload"] for row in printed] == ["shared-prefix", "no-sharing"]
    for row in printed:
        ours = row["radixmesh"]
        # with unbounded capacity the radix cache finds every reusable token, and only those
        assert row["radixmesh_unbounded_hit_rate"] == row["ideal_hit_rate"]
        assert ours["evicted_tokens"] > 0, "the default capacity must force eviction"
        assert ours["cached_tokens"] <= row["capacity_tokens"]
        assert ours["rejected"] == 0
        assert ours["requests_per_s"] > 0 and 0 <= ours["match_us_p50"] <= ours["match_us_p99"]
    assert printed[0]["ideal_hit_rate"] > 0.8 and printed[1]["ideal_hit_rate"] < 0.01


def test_simple_trie_agrees_with_a_brute_force_ideal() -> None:
    requests = workloads.multi_turn(seed=3, conversations=5, turns=3)
    seen: list[list[int]] = []
    hits = total = 0
    for req in requests:
        best = max((_common(req.prompt, s) for s in seen), default=0)
        hits += min(best, len(req.prompt) - 1)
        total += len(req.prompt)
        seen.append(req.prompt)
        seen.append(req.prompt + req.output[:-1])
    assert run_simple_trie(requests, None, window=1, memory=False, quiet=True).hit_rate == (
        hits / total
    )


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_mooncake_expansion_shares_exactly_the_equal_hash_ids(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    records = [
        {"timestamp": 0, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 1024, "output_length": 16, "hash_ids": [0, 1]},
        {"timestamp": 9, "input_length": 600, "output_length": 16, "hash_ids": [0, 7]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    a, b, c = workloads.mooncake(trace, block_tokens=32)
    assert [len(r.prompt) for r in (a, b, c)] == [69, 64, 38]  # lengths scaled by 32 / 512
    assert len(a.output) == 4 and b.arrival_ms == 5
    assert a.prompt[:64] == b.prompt
    assert c.prompt[:32] == a.prompt[:32] and c.prompt[32:] != a.prompt[32:38]


@pytest.mark.skipif(TRACE_ABSENT, reason="the Mooncake trace is not beside the project")
def test_real_trace_loads_with_its_documented_shape() -> None:
    requests = workloads.mooncake(limit=50)
    assert len(requests) == 50
    assert all(r.prompt and r.output for r in requests)
    assert requests[0].prompt[:32] == requests[1].prompt[:32]  # both start with hash id 0
