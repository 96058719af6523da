"""benchmarks/scoring_bench.py on the tiny model: every variant is timed, the scored one with
its prompt's logprobs (the benchmark checks it); no timings asserted."""

from __future__ import annotations

import json

from benchmarks import scoring_bench


def test_every_variant_is_timed(capsys) -> None:  # type: ignore[no-untyped-def]
    code = scoring_bench.main(["--model", "tiny", "--prompt-tokens", "48", "--rounds", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["seconds"]) == set(scoring_bench.VARIANTS)
    assert all(seconds > 0 for seconds in result["seconds"].values())
    assert result["scored_vs_plain"] > 0
