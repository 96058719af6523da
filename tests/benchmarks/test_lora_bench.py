"""The LoRA benchmark's code path on the tiny model (no timings asserted): every case measured,
the batches cut into one segment per adapter, ratios taken against the base row, a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.lora_bench import Workload, build_stacks, main, parse_args, slots_of
from worker.model_runner import ModelRunner
from worker.tiny_model import TINY_CONFIG, tiny_model


def test_sequences_are_grouped_into_one_run_per_adapter() -> None:
    assert slots_of(8, 0) == [-1] * 8
    assert slots_of(8, 1) == [0] * 8
    assert slots_of(8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert slots_of(16, 16) == list(range(16))
    assert slots_of(4, 16) == [0, 4, 8, 12]  # more adapters than sequences: one each


def test_a_workload_step_has_one_segment_per_adapter() -> None:
    model = tiny_model(TINY_CONFIG, seed=0)
    args = parse_args(["--model", "tiny", "--decode-batch", "8", "--decode-context", "5"])
    stacks = build_stacks(model, 4, 16, ("q_proj", "v_proj"))
    assert stacks.modules_in_use(range(4)) == ("q_proj", "v_proj")
    runner = ModelRunner(model, 200, 16, lora=stacks)
    workload = Workload(runner, args, slots_of(8, 4), slots_of(4, 4))
    batch = runner.build_batch(workload.decode_chunks)
    assert batch.is_decode and batch.num_tokens == 8
    assert batch.lora_seg_slots is not None and batch.lora_seg_starts is not None
    assert batch.lora_seg_slots.tolist() == [0, 1, 2, 3]
    assert batch.lora_seg_starts.tolist() == [0, 2, 4, 6, 8]
    prefill = runner.build_batch(workload.prefill_chunks)
    assert prefill.num_tokens == 4 * 256 and prefill.lora_slots == (0, 1, 2, 3)


def test_smoke_run_measures_every_case(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["--model", "tiny", "--repeats", "2", "--adapters", "1", "4", "--targets", "all", "qv"]
    argv += ["--decode-batch", "4", "--decode-context", "8", "--decode-steps", "2"]
    argv += ["--prefill-seqs", "2", "--prefill-len", "16", "--plot", str(tmp_path / "lora.png")]
    argv += ["--clock", "cpu"]
    assert main([*argv, "--output", str(tmp_path / "lora.json")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "lora.json").read_text())
    assert result["clock"] == "cpu"
    labels = [row["case"] for row in result["rows"]]
    assert labels == [
        "base, no stacks",
        "base, stacks loaded",
        "1 adapter, all",
        "4 adapters, all",
        "1 adapter, qv",
        "4 adapters, qv",
    ]
    base = result["rows"][0]
    assert base["decode_ratio"] == base["prefill_ratio"] == 1.0
    for row in result["rows"]:
        assert len(row["decode_samples"]) == len(row["prefill_samples"]) == 2
        assert row["decode_samples"][0]["tokens"] == 4 * 2  # 4 sequences, 2 steps
        assert row["prefill_samples"][0]["tokens"] == 2 * 16
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
    four = [row for row in result["rows"] if row["adapters"] == 4]
    met = all(min(r["decode_ratio"], r["prefill_ratio"]) >= 0.8 for r in four)
    assert result["within_target"] == met
    assert result["stacks_mb"]["qv"] < result["stacks_mb"]["all"]
    assert (tmp_path / "lora.png").stat().st_size > 1000
