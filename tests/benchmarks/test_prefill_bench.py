"""The prefill benchmark's FLOP model and a smoke run on the tiny model (no timings asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.prefill_bench import BIG, main, prefill_flops
from worker.tiny_model import TINY_CONFIG


def test_flop_model_counts_the_uncached_suffix() -> None:
    full = prefill_flops(BIG, 0, 1024)
    assert prefill_flops(BIG, 512, 1024) / full == pytest.approx(0.5, abs=0.05)
    assert prefill_flops(BIG, 993, 1024) / full < 0.05
    ratios = [prefill_flops(TINY_CONFIG, p, 200) for p in range(0, 200, 20)]
    assert ratios == sorted(ratios, reverse=True)


def test_smoke_run_reports_every_section(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--models", "tiny", "--prompt-len", "64", "--decode-tokens", "6", "--repeats", "1"]
    assert main([*argv, "--decode-prompt-len", "8", "--fractions", "0.5", "0.9"]) == 0
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]
    ttft = result["ttft"]
    assert [row["cached_tokens"] for row in ttft["cached"]] == [32, 48]  # whole 16-token pages
    assert all(0 < row["flop_ratio"] < 1 for row in ttft["cached"])
    decode = result["decode"]
    assert decode["new_tokens"] == 6 and decode["speedup"] > 0
    assert "transformers_generate" not in decode  # only for the real checkpoint
    assert "host_tier" not in result  # not in the default sections


def test_host_tier_section_serves_the_prompt_from_promoted_pages(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--models", "tiny", "--prompt-len", "64", "--repeats", "2", "--sections", "host-tier"]
    assert main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]
    assert "ttft" not in result and "decode" not in result
    host = result["host_tier"]
    # the whole prompt but its last position, from 4 pages of 16 demoted then promoted back
    assert host["device_cached_tokens"] == host["host_cached_tokens"] == 63
    assert host["demoted_pages"] == host["promoted_pages"] == [4, 4]
    assert host["host_hit_tokens"] == [63, 63]
    assert host["same_first_token"]
    assert len(host["ttft_ms"]["host"]) == 2 and host["host_hit_ratio"] > 0
    assert host["within_target"] == (host["host_hit_ratio"] <= host["target_ratio"])
