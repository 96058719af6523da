"""benchmarks/kernels_bench.py imports everywhere and runs with CUDA (its refusal without CUDA:
tests/benchmarks/test_cuda_only_benchmarks.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_bench.py"


def test_cost_model_counts_the_visible_pairs() -> None:
    from benchmarks.kernels_bench import HEAD_DIM, Q_HEADS, prefill_cost

    flops, nbytes = prefill_cost(batch=1, prefix=3, suffix=2)
    assert flops == 4 * Q_HEADS * HEAD_DIM * (2 * 3 + 3)  # rows see 4 and 5 keys
    decode_flops, _ = prefill_cost(batch=2, prefix=9, suffix=1)
    assert decode_flops == 4 * Q_HEADS * HEAD_DIM * 2 * 10
    assert nbytes > 0


@pytest.mark.gpu
def test_quick_run_prints_one_json_object(tmp_path: Path) -> None:
    output = tmp_path / "kernels.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(output)],
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["peaks"]["matmul_tflops"] > 0 and result["peaks"]["copy_gbs"] > 0
    kernels = {(row["kernel"], row["backend"]) for row in result["rows"]}
    assert {("prefill", "triton"), ("decode", "triton")} <= kernels
    assert json.loads(output.read_text()) == result


def test_rows_relate_to_the_fastest_flash_and_print_as_a_table() -> None:
    from benchmarks.kernels_bench import make_row, relate_to_flash, table

    peaks = {"matmul_tflops": 800.0, "copy_gbs": 3000.0}
    cost = (8e12, 1e9)  # 10 ms of FLOPs at the peak, 0.33 ms of bytes
    rows = relate_to_flash([
        make_row("prefill", "triton", 16, (1, 1024, 1024), 12.5, cost, peaks),
        make_row("prefill", "flash-dense", 0, (1, 1024, 1024), 10.0, cost, peaks),
    ])  # fmt: skip
    assert rows[0].floor_ms == pytest.approx(10.0) and rows[0].of_floor == pytest.approx(0.8)
    assert rows[0].of_flash == pytest.approx(0.8) and rows[1].of_flash == pytest.approx(1.0)
    assert rows[0].tflops == pytest.approx(640.0)
    text = table(rows, peaks)
    assert "of flash" in text.splitlines()[1] and "flash-dense" in text
