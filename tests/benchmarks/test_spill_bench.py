"""benchmarks/spill_bench.py on the tiny model: with what eviction drops written to disk, the
turns find on disk what the tiers alone lost."""

from __future__ import annotations

import json

from benchmarks import spill_bench


def test_the_disk_tier_serves_what_both_tiers_evicted(capsys) -> None:  # type: ignore[no-untyped-def]
    code = spill_bench.main(
        ["--model", "tiny", "--conversations", "4", "--turns", "3", "--user", "64",
         "--decode", "8", "--device-pages", "24", "--host-pages", "16", "--think-s", "0.2"]
    )  # fmt: skip
    assert code == 0
    runs = {r["mode"]: r for r in json.loads(capsys.readouterr().out.splitlines()[0])["runs"]}
    unbounded, tiers, disk = runs["unbounded"], runs["tiers"], runs["tiers + disk"]
    assert unbounded["hit_rate"] > tiers["hit_rate"], "the tiers must be too small to hold it"
    assert tiers["spilled_pages"] == tiers["disk_hit_tokens"] == 0
    # the tiny model recomputes faster than it reads: most disk hits are priced out, but the
    # first is read (worker/tier_costs.py reads until it has seen a read)
    assert disk["spilled_pages"] > 0 and disk["disk_hit_tokens"] > 0
    assert disk["prompt_tokens"] == tiers["prompt_tokens"] == unbounded["prompt_tokens"]
