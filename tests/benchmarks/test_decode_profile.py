"""benchmarks/decode_profile.py on the tiny model: every op lands in one part, the projections
and the head are counted as the linear part (one op each), no timings asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks.decode_profile import CATEGORIES, category, main
from worker.tiny_model import TINY_CONFIG


def test_ops_fall_into_their_parts() -> None:
    assert category("aten::mm") == "linear"
    assert category("aten::_weight_int4pack_mm_for_cpu") == "linear"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("aten::index_copy_") == "kv write"
    assert category("aten::rms_norm") == "other"


@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_a_decode_step_profile_of_the_tiny_model(weights: str, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--model", "tiny", "--weights", weights, "--steps", "4", "--threads", "1"]
    assert main([*argv, "--context", "20"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["weights"] == weights and result["step_ms"] > 0 and result["forward_ms"] > 0
    assert set(result["op_share"]) <= {*CATEGORIES, "other"}
    assert sum(result["op_share"].values()) == pytest.approx(1)
    # 7 projections a layer and the (untied) head, each one linear op called from Python; a
    # quantized format multiplies q/k/v and gate/up as one each (worker/fused_projections.py)
    per_layer = 7 if weights == "float32" else 4
    assert result["ops_per_step"]["linear"] == per_layer * TINY_CONFIG.num_layers + 1
    assert result["ops_per_step"]["kv write"] == 2 * TINY_CONFIG.num_layers
