"""benchmarks/decode_ab.py on the tiny model: every variant is timed at every context, and the
model is left as it was loaded (fused, with the step memo, decoding through the flat loop); no
timings asserted."""

from __future__ import annotations

import json

from benchmarks.decode_ab import VARIANTS, main, measure
from benchmarks.weights_axis import load_for_bench
from kernels import torch_sdpa


def test_the_variants_are_timed_and_the_model_restored(capsys) -> None:  # type: ignore[no-untyped-def]
    memo = torch_sdpa._STEP_MEMO
    argv = ["--model", "tiny", "--weights", "int4", "--context", "8", "20", "--steps", "2"]
    assert main([*argv, "--rounds", "1", "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["step_ms"]) == {"8", "20"}
    for row in result["step_ms"].values():
        assert set(row) == set(VARIANTS) and all(ms > 0 for ms in row.values())
    assert torch_sdpa._STEP_MEMO is memo, "the real memo is put back"


def test_measure_leaves_the_model_fused_and_decoding_through_the_flat_loop() -> None:
    model = load_for_bench("tiny", "int4")
    fused = [(layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for layer in model.model.layers]
    times = measure(model, 8, 2, 1)
    assert set(times) == set(VARIANTS)
    assert model.flat_decode and model.decode_layers() is not None
    for layer, (qkv, gate_up) in zip(model.model.layers, fused, strict=True):
        assert layer.self_attn.qkv_proj is qkv and layer.mlp.gate_up_proj is gate_up
