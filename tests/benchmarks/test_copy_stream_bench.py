"""benchmarks/copy_stream_bench.py: its four paths on the tiny model (the CPU, where both tiers
are RAM), the cases it parses, and a clear refusal without CUDA."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.copy_stream_bench import measure, parse_case
from tests.worker.helpers import LLAMA

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "copy_stream_bench.py"


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script really benchmarks")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeats", "1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2, f"exit {done.returncode}; stderr: {done.stderr}"
    assert "needs a CUDA device" in done.stderr
    assert done.stdout == ""
