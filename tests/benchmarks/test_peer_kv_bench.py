"""The peer KV benchmark on the tiny model with small counts: a JSON line per measurement and
the table; every way draws the same first token, and the peer way read the prompt's whole pages
from A (no timing is asserted).

On the tiny model a forward pass is cheaper than a read, so worker B would price reads out once
it has seen `min_passes` (8, after 2 warm-up ones) passes (worker/tier_costs.py); here it has
counted 6 by the last read (a pass per measurement, the warm-up round's included), so every
read is made. More rounds or cases would make this test see reads priced out."""

from __future__ import annotations

import json

import pytest

from benchmarks import peer_kv_bench


def test_the_peer_way_reads_the_prompt_and_draws_the_same_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model", "tiny", "--prompt-tokens", "64", "100", "--rounds", "2", "--suffix", "8"]
    assert peer_kv_bench.main(argv) == 0
    captured = capsys.readouterr()
    reports = [json.loads(line) for line in captured.out.splitlines()]
    assert len(reports) == 2 * 2 * 3
    cases = {(r["prompt_tokens"], r["round"], r["way"]): r for r in reports}
    ways = peer_kv_bench.ALL_WAYS
    assert set(cases) == {(p, n, w) for p in (64, 100) for n in (0, 1) for w in ways}
    for p in (64, 100):
        whole = p // 16 * 16  # the engine's pages are of 16
        for n in (0, 1):
            recompute, peer, held = (cases[(p, n, w)] for w in ("recompute", "peer", "held"))
            assert recompute["first_token"] == peer["first_token"] == held["first_token"]
            assert recompute["cached_prompt_tokens"] == recompute["peer_read_tokens"] == 0
            assert recompute["worker"] == peer["worker"] == "b" and held["worker"] == "a"
            assert peer["cached_prompt_tokens"] == peer["peer_read_tokens"] == whole
            assert peer["peer_skipped_tokens"] == peer["peer_read_failures"] == 0
            assert peer["kv_bytes_read"] > 0
            assert held["cached_prompt_tokens"] >= whole
    # the ways alternate: round 0 recomputes first on B, round 1 reads first
    order = [(r["round"], r["way"]) for r in reports if r["prompt_tokens"] == 64]
    b_first = [(0, "recompute"), (0, "peer"), (1, "peer"), (1, "recompute")]
    assert [x for x in order if x[1] != "held"] == b_first
    assert order[0] == (0, "held") and order[3] == (1, "held")  # A's comes before B's
    assert "TTFT, ms" in captured.err and "warning" not in captured.err
