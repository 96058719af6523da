"""The vision benchmark's code path on the tiny checkpoint (no timings asserted): each case does
what its row says it measures, read from the engine's own counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.vision_bench import main

pytest.importorskip("transformers")


def test_each_case_runs_what_it_claims(tmp_path: Path) -> None:
    lines: list[str] = []
    output = tmp_path / "vision.json"
    args = [
        "--models",
        "tiny",
        "--repeats",
        "1",
        "--image-size",
        "60",
        "40",
        "--longest-edge",
        "64",
    ]
    (result,) = main([*args, "--output", str(output)], out=lines.append)
    assert json.loads(lines[0]) == result == json.loads(output.read_text())[0]
    assert result["frames"] == 5 and result["image_positions"] == 20  # 2 x 2 tiles + global
    cases = result["cases"]
    prompt = cases["cold"]["prompt_tokens"]
    assert prompt > cases["turn1"]["prompt_tokens"] > result["image_positions"]
    for case in ("turn1", "cold"):  # nothing cached: the encoder runs
        assert cases[case]["cached_tokens"] == 0 and cases[case]["encoder_runs"] == 1
    follow = cases["follow_up"]  # turn 1 cached, image included: no encoder
    assert cases["turn1"]["prompt_tokens"] - 16 <= follow["cached_tokens"] < prompt
    assert follow["encoder_runs"] == 0 and follow["encoder_cache_hits"] == 0
    kept, lost = cases["encoder_cache"], cases["no_encoder_cache"]  # KV evicted before each
    assert kept["cached_tokens"] == lost["cached_tokens"] == 0
    assert (kept["encoder_runs"], kept["encoder_cache_hits"]) == (0, 1)
    assert (lost["encoder_runs"], lost["encoder_cache_hits"]) == (1, 0)
    assert result["encoder_seconds_saved"] == lost["encoder_s"] > 0


def test_repeats_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        main(["--models", "tiny", "--repeats", "0"])
