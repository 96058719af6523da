"""Fused projections (worker/fused_projections.py): q/k/v and gate/up multiplied as one layer give
each part's outputs bit for bit, on the decode kernels' path and the prefill path, with padding
between int4 parts and without; the parts become views of the fused buffers (memory counted
once) and still multiply alone; a whole quantized model gives the same logits fused or not, on
prefill and decode steps, LoRA included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.worker.test_lora_model import random_adapter, stacks_with
from tests.worker.test_weight_formats import forced, prompt
from worker.config import ModelConfig
from worker.fused_projections import FusedProjections, fuse_projections
from worker.model_runner import ModelRunner
from worker.quantized_linear import FLOAT32_ROWS, LinearFormat, QuantizedLinear
from worker.tiny_model import TINY_CONFIG, TINY_QWEN3_CONFIG, tiny_model
from worker.weight_formats import apply_weight_format, weight_bytes

FORMATS: list[LinearFormat] = ["bf16", "int8", "int4"]
SHAPES = {"padded": (100, 40, 40), "whole blocks": (128, 64, 64)}


def parts_of(
    sizes: tuple[int, ...], fmt: LinearFormat, bias: bool, seed: int
) -> list[QuantizedLinear]:
    gen = torch.Generator().manual_seed(seed)
    return [
        QuantizedLinear(
            torch.randn(out, 96, generator=gen) / 96**0.5,
            fmt,
            torch.randn(out, generator=gen) if bias else None,
        )
        for out in sizes
    ]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fused_layer_gives_each_part_bit_for_bit(
    fmt: LinearFormat, bias: bool, shape: str
) -> None:
    parts = parts_of(SHAPES[shape], fmt, bias, seed=len(shape) + 7 * bias)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(rows, 96, generator=gen) for rows in (1, min(FLOAT32_ROWS[fmt], 64) + 3)]
    before = [[part(x) for part in parts] for x in inputs]
    fused = FusedProjections(parts)
    for x, expected in zip(inputs, before, strict=True):
        y = fused(x)
        got = fused.split(y)
        assert [t.shape for t in got] == [e.shape for e in expected]
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e), f"{fmt}, {x.shape[0]} rows: a fused output differs"
        for part, e in zip(parts, expected, strict=True):  # the parts, now views, alone
            assert torch.equal(part(x), e)
    padded = fmt == "int4" and shape == "padded"
    assert fused.adjacent is not padded


@pytest.mark.parametrize("fmt", FORMATS)
def test_parts_are_views_of_the_fused_buffers_so_memory_is_counted_once(fmt: LinearFormat) -> None:
    parts = parts_of(SHAPES["whole blocks"], fmt, bias=True, seed=1)
    alone = sum(p.nbytes for p in parts)
    holder = nn.ModuleList(parts)
    assert weight_bytes(holder) == alone
    fused = FusedProjections(parts)
    holder.append(fused)
    assert weight_bytes(holder) == alone, "the fused buffers are the parts' storage"
    storage = {t.untyped_storage().data_ptr() for t in fused.buffers()}
    for part in parts:
        assert {t.untyped_storage().data_ptr() for t in part.buffers()} <= storage


def test_concat_refuses_parts_of_different_kinds() -> None:
    int4, int8 = parts_of((64,), "int4", False, 0)[0], parts_of((64,), "int8", False, 0)[0]
    with pytest.raises(ValueError, match="one kind"):
        QuantizedLinear.concat([int4, int8])
    with pytest.raises(ValueError, match="one kind"):
        QuantizedLinear.concat([int4])
    biased = parts_of((64,), "int4", True, 0)[0]
    with pytest.raises(ValueError, match="bias"):
        QuantizedLinear.concat([int4, biased])


def unfused_twin(model: nn.Module) -> None:
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.self_attn.qkv_proj = None
        layer.mlp.gate_up_proj = None


@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_QWEN3_CONFIG], ids=["llama", "qwen3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_model_gives_the_same_logits_fused_or_not(fmt: LinearFormat, config: ModelConfig) -> None:
    """Prefill in two chunks (below and above FLOAT32_ROWS rows each, where the format has a
    float32 path), then decode steps, with
    and without a LoRA adapter on every projection: fused and unfused logits equal bit for bit
    (q and k rotated as one tensor where the fused layout allows it: Llama, no LoRA)."""
    assert fuse_projections(tiny_model(config)) == 0, "float32 nn.Linear layers stay apart"
    fused = apply_weight_format(tiny_model(config), fmt)
    separate = apply_weight_format(tiny_model(config), fmt)
    unfused_twin(separate)
    adapters = {
        1: random_adapter(config, "all", rank=4, seed=2),
        2: random_adapter(config, "some", rank=4, modules=("v_proj", "up_proj"), seed=3),
    }  # "some": one part of each fused group, its terms added in place into the fused output
    stacks = stacks_with(config, adapters)
    for length in (20, 140):
        ids, follow = prompt(length, length), prompt(length + 1, 3)
        for slot in (-1, 1, 2):
            got, want = (
                forced(ModelRunner(model, 48, 4, lora=stacks), ids, follow, slot)
                for model in (fused, separate)
            )
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), f"{fmt}, {length} tokens, slot {slot}: logits differ"
