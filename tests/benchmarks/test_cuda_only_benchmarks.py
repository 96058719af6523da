"""The benchmarks that measure only on a GPU refuse clearly without one: exit status 2, a line
saying a CUDA device is needed, and nothing on stdout (no result a caller could mistake for a
measurement)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
CUDA_ONLY = {
    "kernels_bench.py": ["--quick"],
    "copy_stream_bench.py": ["--repeats", "1"],
    "gpu_decode_bench.py": ["--repeats", "1"],
    "draft_step_bench.py": ["--steps", "1"],
    "quant_matmul_gpu_bench.py": ["--quick"],
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the scripts really benchmark")
@pytest.mark.parametrize("script", CUDA_ONLY)
def test_without_cuda_it_says_so_and_exits_2(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *CUDA_ONLY[script]],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 2, f"exit {done.returncode}; stderr: {done.stderr}"
    assert "needs a CUDA device" in done.stderr
    assert done.stdout == "", "nothing measured, nothing printed as a result"
