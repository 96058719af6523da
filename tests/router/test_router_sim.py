"""benchmarks/router_sim.py: the keys it reports, the references, and cache_aware beating round
robin by a wide margin on a small seeded workload (a real assertion)."""

from __future__ import annotations

import json

import pytest

from benchmarks import router_sim, workloads

KEYS = {
    "policy",
    "hit_rate",
    "pooled_hit_rate",
    "fraction_of_pooled",
    "imbalance",
    "window_imbalance_max",
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_floor_p50_s",
    "ttft_floor_p99_s",
    "decisions_per_s",
    "decision_p99_us",
    "index_bytes",
}


def simulate(*argv: str) -> dict[str, dict]:
    rows = router_sim.run(router_sim.parse_args(["--quiet", *argv]))
    return {row["policy"]: row for row in rows}


def test_small_shared_prefix_workload_cache_aware_beats_round_robin_widely(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 4 few-shot templates of 4096 tokens over 4 workers that can each hold one
    rows = simulate(
        "--workload", "few-shot", "--limit", "600", "--workers", "4",
        "--capacity-tokens", "6000", "--seed", "3",
    )  # fmt: skip
    assert set(rows) == set(router_sim.POLICIES)
    for row in rows.values():
        assert row.keys() >= KEYS
        assert 0 <= row["hit_rate"] <= 1 and row["requests"] == 600
    ours, rr = rows["cache_aware"], rows["round_robin"]
    assert ours["hit_rate"] >= rr["hit_rate"] + 0.3, (ours["hit_rate"], rr["hit_rate"])
    assert ours["fraction_of_pooled"] >= 0.9
    assert ours["ttft_p50_s"] < rr["ttft_p50_s"]
    assert ours["ttft_p50_s"] >= ours["ttft_floor_p50_s"] - 1e-9
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["policy"] for p in printed] == list(rows)


def test_deterministic_for_a_seed() -> None:
    argv = ("--workload", "multi-turn", "--limit", "30", "--policy", "cache_aware")
    first, second = simulate(*argv), simulate(*argv)
    drop = {"decisions_per_s", "decision_p50_us", "decision_p99_us", "wall_s"}
    strip = [{k: v for k, v in r["cache_aware"].items() if k not in drop} for r in (first, second)]
    assert strip[0] == strip[1]


def test_decision_rate_mode_reports_its_measurement() -> None:
    (row,) = router_sim.run(router_sim.parse_args(["--decisions", "300", "--workers", "8"]))
    assert row["measurement"] == "decision_rate" and row["decisions_per_s"] > 0
    assert row["workers"] == 8 and row["prompt_tokens"] == 10_000


@pytest.mark.skipif(not workloads.MOONCAKE_TRACE.exists(), reason="Mooncake trace absent")
def test_mooncake_trace_head() -> None:
    rows = simulate("--limit", "300", "--policy", "cache_aware")
    row = rows["cache_aware"]
    assert row.keys() >= KEYS and row["requests"] == 300
    assert row["hit_rate"] <= row["pooled_hit_rate"] + 0.02


def test_a_host_tier_brings_back_what_the_device_evicted() -> None:
    # multi-turn conversations on workers whose device holds little: the host tier keeps turns
    argv = ("--workload", "multi-turn", "--limit", "100", "--workers", "2", "--seed", "1",
            "--capacity-tokens", "20000", "--policy", "cache_aware")  # fmt: skip
    device = simulate(*argv)["cache_aware"]
    tiered = simulate(*argv, "--host-tokens", "160000")["cache_aware"]
    assert "host_tokens" not in device, "without tiers the output is as it always was"
    assert tiered["host_tokens"] == 160000 and tiered["host_rate"] == 10 * 8000.0
    assert tiered["host_hit_rate"] > 0.3
    assert tiered["hit_rate"] > device["hit_rate"] + 0.3, (tiered["hit_rate"], device["hit_rate"])
    assert tiered["ttft_p50_s"] < device["ttft_p50_s"]


def test_lora_workload_adapter_aware_routing_swaps_less_than_blind() -> None:
    """Zipf over 16 adapters, 4 slots a worker: pricing the swap gathers each adapter's
    requests where it is resident (fewer swaps, lower mean TTFT) at the same hit rate."""
    rows = simulate(
        "--workload", "lora-zipf", "--limit", "800", "--workers", "4", "--adapters", "16",
        "--max-loras", "4", "--swap-ms", "50", "--policy", "cache_aware", "--seed", "1",
    )  # fmt: skip
    aware, blind = rows["cache_aware"], rows["cache_aware-adapter_blind"]
    for row in (aware, blind):
        assert row.keys() >= KEYS and row["requests"] == 800
        assert (row["adapters"], row["max_loras"], row["swap_ms"]) == (16, 4, 50.0)
    assert aware["adapter_swaps"] < 0.6 * blind["adapter_swaps"], (aware, blind)
    assert aware["ttft_mean_s"] < blind["ttft_mean_s"]
    assert aware["hit_rate"] >= blind["hit_rate"] - 0.02


def test_lora_workload_draws_adapters_by_zipf() -> None:
    requests = workloads.lora_zipf(seed=0, n=4000, adapters=8, zipf=1.1)
    counts = [sum(r.adapter == f"lora-{k}" for r in requests) for k in range(8)]
    assert sum(counts) == 4000 and counts[0] > counts[1] > counts[3] > counts[7] > 0
    assert 1.8 < counts[0] / counts[1] < 2.6  # 2^1.1 = 2.14
    # an adapter's requests share its system prompts; none crosses adapters
    heads = {r.adapter: set() for r in requests}  # type: dict[str | None, set[tuple[int, ...]]]
    for r in requests:
        heads[r.adapter].add(tuple(r.prompt[:64]))
    assert all(len(h) == 2 for h in heads.values())
    assert len(set().union(*heads.values())) == 16


def test_batch_work_at_priority_1_and_routing_that_knows_it() -> None:
    """`--batch-share`: 40 % of multi-turn requests are batch work at priority 1, the workers
    admit by priority and preempt a less urgent prefill; routing that prices each queue by the
    share ahead of the request (cache_aware) serves the interactive ones sooner than routing
    that counts whole queues (the priority_blind run)."""
    rows = simulate(
        "--workload", "multi-turn", "--limit", "400", "--workers", "4", "--load", "0.9",
        "--capacity-tokens", "40000", "--policy", "cache_aware", "--batch-share", "0.4",
        "--seed", "1",
    )  # fmt: skip
    aware, blind = rows["cache_aware"], rows["cache_aware-priority_blind"]
    for row in (aware, blind):
        assert row["batch_share"] == 0.4
        assert row["interactive_requests"] + row["batch_requests"] == row["requests"]
        assert 0.3 < row["batch_requests"] / row["requests"] < 0.5
        assert row["interactive_ttft_p50_s"] <= row["batch_ttft_p50_s"]
    assert aware["interactive_ttft_p90_s"] < 0.8 * blind["interactive_ttft_p90_s"], (aware, blind)
    assert "batch_share" not in simulate("--workload", "multi-turn", "--limit", "30")["cache_aware"]


@pytest.mark.skipif(not workloads.MOONCAKE_TRACE.exists(), reason="Mooncake trace absent")
def test_peer_reads_serve_moved_prefixes_and_pricing_them_moves_more() -> None:
    """`--peer-rate`: on the trace's head, workers read the prefix from the worker the router
    names instead of recomputing it (more of each prompt served from cache, sooner first
    tokens), and cache_aware pricing a move as that read moves more and waits less."""
    rows = simulate("--limit", "3000", "--policy", "cache_aware", "--peer-rate", "80000")
    plain, reads = rows["cache_aware"], rows["cache_aware+peer_reads"]
    priced = rows["cache_aware+peer_priced"]
    timings = {"decisions_per_s", "decision_p50_us", "decision_p99_us", "wall_s"}
    alone = simulate("--limit", "3000", "--policy", "cache_aware")["cache_aware"]
    assert {k: v for k, v in plain.items() if k not in timings} == {
        k: v for k, v in alone.items() if k not in timings
    }, "without reads the output is as it always was"
    for row in (reads, priced):
        assert row["peer_rate"] == 80000 and row["peer_read_rate"] > 0.005
        assert row["hit_rate_with_reads"] > plain["hit_rate"] + 0.01
        assert row["ttft_mean_s"] < plain["ttft_mean_s"] and row["ttft_p50_s"] < plain["ttft_p50_s"]
    assert priced["peer_read_rate"] > 2 * reads["peer_read_rate"], "priced moves read more"
    assert priced["ttft_p50_s"] < reads["ttft_p50_s"]


def test_priced_reads_never_count_on_what_no_device_holds_yet() -> None:
    """few-shot: requests routed together share a 4,096-token template still pending on its
    first worker. Priced up to what a device holds, reads change nothing there; priced up to
    the pending routes too, requests moved to recompute what was priced as a read."""
    rows = simulate("--workload", "few-shot", "--policy", "cache_aware", "--peer-rate", "80000")
    plain, priced = rows["cache_aware"], rows["cache_aware+peer_priced"]
    assert priced["ttft_mean_s"] <= plain["ttft_mean_s"] * 1.01, (priced, plain)
    error = priced["prediction_error_tokens_mean"]
    assert error <= plain["prediction_error_tokens_mean"] + 1
