"""worker/decode_layers.py: the flat CPU decode loop gives the module path's values bit for bit,
runs where it applies, and leaves every other step to the modules."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from tests.worker.test_lora_model import random_adapter, stacks_with
from worker.config import ModelConfig
from worker.decode_layers import DecodeLayers
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.quantized_weights import WeightFormat
from worker.tiny_model import TINY_CONFIG, TINY_QWEN3_CONFIG, tiny_model
from worker.weight_formats import apply_weight_format

FORMATS: list[WeightFormat] = ["bf16", "int8", "int4"]
PADDED_CONFIG = replace(TINY_CONFIG, num_heads=6, num_kv_heads=2, intermediate_size=96)
"""q (96 rows) and gate (96) are not whole int4 blocks of 64 rows: in int4 they are padded, so q
and k do not lie side by side (two rotations) and up does not start where gate ends."""
CONFIGS = {"llama": TINY_CONFIG, "padded": PADDED_CONFIG}
PAGE_SIZE = 4
PAGES_PER_SEQUENCE = 8
ROWS = (1, 5, 70)
"""Decode batches of 1, 5 and 70 sequences: 70 is past int8's FLOAT32_ROWS (64), so its linears
take the float32 path there, and the kernels at 1 and 5 (int4 and bf16 as this CPU runs them)."""


@pytest.fixture
def flat_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many forward passes ran the flat loop (a spy around the real `run`)."""
    counted: list[int] = []
    real = DecodeLayers.run

    def counting(self: DecodeLayers, *args: object, **kwargs: object) -> torch.Tensor:
        counted.append(1)
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DecodeLayers, "run", counting)
    yield counted


def prefilled(
    model: CausalLM, sequences: int, lora: object = None, page_size: int = PAGE_SIZE
) -> tuple[ModelRunner, list]:
    """A runner whose `sequences` prompts (5 to 13 tokens) are prefilled, and one decode chunk
    per sequence (each sequence's pages consecutive)."""
    per_sequence = PAGES_PER_SEQUENCE * PAGE_SIZE // page_size
    runner = ModelRunner(
        model,
        sequences * per_sequence + 1,
        page_size,
        lora=lora,  # type: ignore[arg-type]
    )
    chunks = []
    for s in range(sequences):
        length = 5 + s % 9
        pages = list(range(1 + s * per_sequence, 1 + (s + 1) * per_sequence))
        ids = [(7 * s + j) % 400 + 3 for j in range(length)]
        runner.run([Chunk(ids, 0, pages, True)])
        chunks.append(Chunk([11 + s], length, pages, True))
    return runner, chunks


def kv_copy(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for layer in runner.kv for t in layer]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_flat_loop_gives_the_module_paths_logits_and_kv_bit_for_bit(
    config: str, fmt: WeightFormat, flat_runs: list[int]
) -> None:
    """The same decode step through the modules, then, from the K/V as it was before that
    step, through the flat loop: equal logits and equal K/V, for every row count."""
    model = apply_weight_format(tiny_model(CONFIGS[config], seed=11), fmt)
    runner, chunks = prefilled(model, max(ROWS))
    for rows in ROWS:
        before = kv_copy(runner)
        model.flat_decode = False
        by_modules = runner.run(chunks[:rows]).clone()
        kv_by_modules = kv_copy(runner)
        assert not flat_runs
        for cache, saved in zip((t for layer in runner.kv for t in layer), before, strict=True):
            cache.copy_(saved)  # the step's slots hold what they held before it: not its K/V
        model.flat_decode = True
        flat = runner.run(chunks[:rows])
        assert len(flat_runs) == 1, "the flat loop did not run"
        flat_runs.clear()
        assert torch.equal(flat, by_modules), (rows, (flat - by_modules).abs().max())
        for got, want in zip(kv_copy(runner), kv_by_modules, strict=True):
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), rows


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_decoding_is_the_same_both_ways(
    config: str, fmt: WeightFormat, flat_runs: list[int]
) -> None:
    """Two runners over one model, one decoding through the modules and one through the flat
    loop, each feeding back its own argmax for 12 steps: the same tokens and logits."""
    model = apply_weight_format(tiny_model(CONFIGS[config], seed=5), fmt)
    outputs: dict[bool, tuple[list[list[int]], list[torch.Tensor]]] = {}
    for flat in (False, True):
        model.flat_decode = flat
        runner, chunks = prefilled(model, 3)
        tokens: list[list[int]] = []
        logits: list[torch.Tensor] = []
        for _ in range(12):
            step = runner.run(chunks).clone()
            logits.append(step)
            picked = step.argmax(-1).tolist()
            tokens.append(picked)
            chunks = [
                Chunk([t], c.start + 1, c.pages, True) for c, t in zip(chunks, picked, strict=True)
            ]
        outputs[flat] = (tokens, logits)
    assert len(flat_runs) == 12
    assert outputs[True][0] == outputs[False][0]
    for got, want in zip(outputs[True][1], outputs[False][1], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("config", "fmt", "why"),
    [
        (TINY_CONFIG, "float32", "no fused projections"),
        (TINY_QWEN3_CONFIG, "int4", "QK-norm"),
        (replace(TINY_CONFIG, architecture="qwen2", attention_bias=True), "int4", "a bias"),
    ],
    ids=["float32", "qwen3-qk-norm", "qwen2-bias"],
)
def test_models_it_was_not_written_for_decode_through_the_modules(
    config: ModelConfig, fmt: WeightFormat, why: str, flat_runs: list[int]
) -> None:
    model = apply_weight_format(tiny_model(config, seed=2), fmt)
    runner, chunks = prefilled(model, 2)
    logits = runner.run(chunks)
    assert torch.isfinite(logits).all()
    assert not flat_runs, why


def test_prefill_and_lora_steps_run_through_the_modules(flat_runs: list[int]) -> None:
    """Prefill chunks, and a decode step with an adapter's rows, keep the module path; a decode
    step of base rows on the same runner takes the flat loop."""
    model = apply_weight_format(tiny_model(TINY_CONFIG, seed=3), "int4")
    stacks = stacks_with(TINY_CONFIG, {1: random_adapter(TINY_CONFIG, "a", rank=4, seed=1)})
    runner, chunks = prefilled(model, 2, lora=stacks)
    assert not flat_runs, "a prefill ran the flat loop"
    adapted = [Chunk(c.token_ids, c.start, c.pages, True, lora_slot=1) for c in chunks]
    runner.run(adapted)
    assert not flat_runs, "a step with LoRA rows ran the flat loop"
    runner.run(chunks)
    assert len(flat_runs) == 1


def test_the_loop_is_rebuilt_when_a_weight_format_fuses_the_projections(
    flat_runs: list[int],
) -> None:
    """A float32 model decodes through the modules (and remembers that its layers are not the
    loop's); converted to int4 in place, its next decode step takes the loop over the new
    modules, with the values the modules give."""
    model = tiny_model(TINY_CONFIG, seed=4)
    runner, chunks = prefilled(model, 2)
    runner.run(chunks)
    assert not flat_runs and model.decode_layers() is None
    apply_weight_format(model, "int4")
    runner, chunks = prefilled(model, 2)
    flat = runner.run(chunks).clone()
    assert len(flat_runs) == 1
    model.flat_decode = False
    assert torch.equal(runner.run(chunks), flat)


def test_the_loop_is_dropped_when_the_activations_change_dtype(flat_runs: list[int]) -> None:
    """Built for float32 activations, the loop is not used once the model is cast to bf16."""
    model = apply_weight_format(tiny_model(TINY_CONFIG, seed=6), "int8")
    assert model.decode_layers() is not None
    model.to(torch.bfloat16)
    assert model.decode_layers() is None
    runner, chunks = prefilled(model, 2)
    assert torch.isfinite(runner.run(chunks)).all()
    assert not flat_runs
