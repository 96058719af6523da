"""benchmarks/structured_bench.py on the tiny model: every variant decodes and is timed, the
constrained ones produce what their constraint says; no timings asserted."""

from __future__ import annotations

import json

from benchmarks import structured_bench


def test_every_variant_is_timed(capsys) -> None:  # type: ignore[no-untyped-def]
    code = structured_bench.main(["--model", "tiny", "--tokens", "24", "--rounds", "1"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["ms_per_token"]) == set(structured_bench.VARIANTS)
    assert all(ms > 0 for ms in result["ms_per_token"].values())
    assert result["tokens_decoded"]["free"] == 24
    assert result["first_structured_ttft_s"] > 0 and result["warm_structured_ttft_s"] > 0
