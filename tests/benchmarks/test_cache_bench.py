"""The cache benchmark's correctness properties (no timings are asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import workloads
from benchmarks.cache_bench import main, run_radixmesh, run_simple_trie
from benchmarks.workloads import Request

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
        assert "tiers" not in ours and "host_capacity_tokens" not in row  # no host tier asked
    assert printed[0]["ideal_hit_rate"] > 0.8 and printed[1]["ideal_hit_rate"] < 0.01


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_pushed_out_prompt_comes_back_from_the_host_tier(page_size: int) -> None:
    a = Request(list(range(1, 65)), list(range(1000, 1008)))
    b = Request(list(range(200, 264)), list(range(2000, 2008)))
    stream = [a, b, a]  # b's pages push most of a out of a 96-token pool
    alone = run_radixmesh(stream, 96, page_size, 0, memory=False, quiet=True)
    tiered = run_radixmesh(stream, 96, page_size, 0, False, True, host_capacity=200)
    prompts = 3 * 64
    kept = round(alone.hit_rate * prompts)  # the head of a that stayed on the device
    assert alone.tiers is None and 0 < kept < 63 and alone.evicted_tokens > 0
    assert round(tiered.hit_rate * prompts) == 63  # all of a's prompt but its last position
    assert tiered.tiers is not None
    assert tiered.tiers.host_hit_tokens == 63 - kept
    assert tiered.tiers.promoted_pages * page_size >= 63 - kept
    assert tiered.tiers.host_evicted_pages == 0  # 200 tokens hold everything pushed down
    # every move of the tree came out as a tier copy the loop drained
    assert tiered.tiers.copied_pages == tiered.tiers.demoted_pages + tiered.tiers.promoted_pages


def test_tiers_mode_runs_device_device_host_unbounded_and_with_a_disk(
    tmp_path: Path, capsys
) -> None:
    out = tmp_path / "tiers.jsonl"
    argv = ["--tiers", "--quick", "--quiet", "--output", str(out)]
    assert main([*argv, "--workloads", "multi-turn", "system-prompts", "--page-size", "16"]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["workload"] for row in printed] == ["multi-turn", "system-prompts"]
    for row in printed:
        runs = row["configs"]
        alone, tiered, best = runs["device_only"], runs["device_host"], runs["unbounded"]
        device = row["device_capacity_tokens"]
        assert row["mode"] == "tiers" and row["host_multiple"] == 8
        assert row["host_capacity_tokens"] == 8 * device
        assert device >= int(0.05 * row["distinct_tokens"])  # 5 %, or twice the largest request
        assert best["hit_rate"] <= row["ideal_hit_rate"]  # whole pages of 16
        assert alone["hit_rate"] <= tiered["hit_rate"] <= best["hit_rate"]
        assert alone["cached_tokens"] <= device and tiered["cached_tokens"] <= device
        assert "tiers" not in alone and "tiers" not in best
        tiers = tiered["tiers"]
        assert tiers["host_capacity_tokens"] == row["host_capacity_tokens"]
        assert tiers["demoted_pages"] > 0 and tiers["promoted_pages"] > 0
        assert tiers["copied_pages"] == tiers["demoted_pages"] + tiers["promoted_pages"]
        assert tiers["host_hit_tokens"] > 0 and tiered["rejected"] == 0
        gap = 100 * (best["hit_rate"] - tiered["hit_rate"])
        assert tiered["gap_points"] == pytest.approx(gap)
        assert tiered["gap_pct_of_unbounded"] == pytest.approx(gap / best["hit_rate"])
        assert row["within_target"] == (tiered["gap_pct_of_unbounded"] <= 5)
        total = runs["device_total"]  # the reference: one pool as large as both tiers
        assert total["cached_tokens"] <= 9 * device and "tiers" not in total
        disk = runs["device_host_disk"]  # the same tiers, what they drop kept on disk
        assert tiered["hit_rate"] <= disk["hit_rate"] <= best["hit_rate"]
        kept = disk["tiers"]  # the host drops whole leaves while spilling: moves differ a little
        assert kept["demoted_pages"] > 0 and kept["host_hit_tokens"] > 0
        assert row["within_target_with_disk"] == (disk["gap_pct_of_unbounded"] <= 5)
    multi_turn = printed[0]["configs"]  # every history comes back: from disk, past both tiers
    assert multi_turn["device_host_disk"]["tiers"]["disk_hit_tokens"] > 0
    assert (
        0 < multi_turn["device_host_disk"]["tiers"]["disk_tokens"] <= printed[0]["distinct_tokens"]
    )
    assert not printed[0]["within_target"] and printed[0]["within_target_with_disk"]
    system_prompts = printed[1]["configs"]
    assert system_prompts["device_host"]["hit_rate"] > system_prompts["device_only"]["hit_rate"]


def test_a_host_tier_in_the_default_mode_and_refused_flags(capsys) -> None:
    argv = ["--quick", "--quiet", "--no-memory", "--workloads", "multi-turn"]
    assert main([*argv, "--host-multiple", "4"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["host_capacity_tokens"] == 4 * row["capacity_tokens"]
    assert row["radixmesh"]["tiers"]["promoted_pages"] > 0
    for wrong in (["--tiers", "--host-multiple", "0"], ["--against", "sglang", "--tiers"]):
        with pytest.raises(SystemExit):
            main(wrong)


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
