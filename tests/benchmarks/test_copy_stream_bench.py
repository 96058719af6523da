"""benchmarks/copy_stream_bench.py: its four paths on the tiny model (the CPU, where both tiers
are RAM) and the cases it parses (its refusal without CUDA: test_cuda_only_benchmarks.py)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.copy_stream_bench import measure, parse_case
from tests.worker.helpers import LLAMA


def test_the_four_paths_serve_the_same_first_token_from_where_they_say() -> None:
    result = measure("tiny", LLAMA, cached=32, new=8, repeats=2, device="cpu")
    assert result["hits_agree"] and result["cold_agrees"]
    assert result["cached_tokens"] == {
        "device": 32, "host_compute_stream": 32, "host_copy_stream": 32, "host_by_size": 32,
    }  # fmt: skip
    assert all(len(times) == 2 and min(times) > 0 for times in result["ttft_ms"].values())
    tiny_page = 2 * LLAMA.num_layers * 16 * LLAMA.num_kv_heads * LLAMA.head_dim * 2  # bf16
    assert result["promoted_mb"] == pytest.approx(2 * tiny_page / 1e6), "one host hit's two pages"


def test_a_case_is_cached_plus_new() -> None:
    assert parse_case("8192+1024") == (8192, 1024)
    for bad in ("8192", "8+1", "1024+0"):
        with pytest.raises(argparse.ArgumentTypeError, match="P\\+N"):
            parse_case(bad)
