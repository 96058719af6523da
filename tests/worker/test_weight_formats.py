"""Weight formats on whole models: what apply_weight_format replaces (a tied head gets its own
copy, the table stays a bf16 lookup), a quantized model computes exactly with the weights it
holds (logits against its dequantized float twin) and stays near float32 (a bound per format),
the cache changes nothing within a format (engine, greedy), LoRA adds its terms on a quantized
base, load_model(weights=...) gives each format its own cache identity, and bad names are
refused naming the field."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.worker import test_engine_equivalence as equivalence
from tests.worker.helpers import no_cache_greedy, recorded_engine, relative_error
from tests.worker.test_lora_model import ATTENTION, random_adapter, stacks_with
from worker import fbgemm_int8, quantized_linear
from worker.config import ModelConfig
from worker.fused_projections import FusedProjections
from worker.loader import load_model, model_revision
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.quantized_linear import INT4_CPU_ROWS, LinearFormat, QuantizedLinear, int4pack_levels
from worker.quantized_weights import QuantizedWeight, WeightFormat, dequantize, quantize
from worker.tiny_model import TINY_CONFIG, TINY_QWEN3_CONFIG, build_tiny_checkpoint, tiny_model
from worker.weight_formats import apply_weight_format, head_format, linear_names, weight_bytes

FORMATS: list[WeightFormat] = ["bf16", "int8", "int4"]
CPU = torch.device("cpu")
CONFIGS = [TINY_CONFIG, TINY_QWEN3_CONFIG]
IDS = ["llama", "qwen3-tied"]
PROJECTIONS = 7  # q k v o gate up down
FUSED_SUFFIXES = ("qkv_proj.linear", "gate_up_proj.linear")
FLOAT32_BOUND = {"bf16": 0.05, "int8": 0.1, "int4": 0.75}
"""Largest relative error norm of the tiny models' logits against float32, per format. Measured
on 20 prompts x 2 seeds x 2 configs: bf16 0.007-0.023, int8 0.015-0.051, int4 0.17-0.48 (random
Gaussian weights with 64 hidden units are int4's worst case: nothing like a trained model's
outliers-plus-bulk, and every error compounds; SmolLM2's quality is benchmarks/weights_quality.py's
to measure). The bounds are about twice the worst seen: a broken format (wrong zero, wrong
group, transposed nibbles) lands far beyond them, near 1."""
TWIN_BOUND = 0.03
"""Against the model's own dequantized weights in float32, the only differences are the
activations' rounding to bf16 at each linear (measured up to 0.016)."""


def prompt(seed: int, length: int = 32) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def last_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=len(ids) + 2, page_size=1)
    return runner.run([Chunk(ids, 0, list(range(1, len(ids) + 1)), True)])[0]


def dequantized_twin(model: CausalLM) -> CausalLM:
    """A float32 CausalLM holding exactly the matrices `model`'s layers multiply by."""
    twin = CausalLM(model.config)
    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            if name.endswith(FUSED_SUFFIXES):  # the fused q/k/v and gate/up: the parts hold it
                continue
            state[f"{name}.weight"] = module.reference_weight()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.float()
    for name, parameter in model.named_parameters():
        state.setdefault(name, parameter.detach().float())
    if twin.lm_head is None:  # a tied config: the quantized head is no longer the table
        twin.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    missing, unexpected = twin.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return twin.eval()


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_projections_and_the_head_are_replaced_and_the_table_is_bf16(
    config: ModelConfig, fmt: WeightFormat
) -> None:
    model = apply_weight_format(tiny_model(config), fmt)
    modules = dict(model.model.named_modules())
    layers = [m for n, m in modules.items() if isinstance(m, QuantizedLinear)]
    fused = [n for n, m in modules.items() if isinstance(m, FusedProjections)]
    assert len(layers) == (PROJECTIONS + 2) * config.num_layers, "7 parts and 2 fused per layer"
    names = sorted(n.rsplit(".", 1)[1] for n in fused)
    assert names == sorted(["qkv_proj", "gate_up_proj"] * config.num_layers)
    assert {layer.format for layer in layers} == {fmt}
    head = model.lm_head
    assert isinstance(head, QuantizedLinear) and head.format == head_format(fmt, CPU)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.dtype == torch.float32, "activations keep the model's dtype"
    assert not [m for m in model.modules() if type(m) is nn.Linear], "a float linear is left"
    table = tiny_model(config).model.embed_tokens.weight.detach()
    assert torch.equal(model.model.embed_tokens.weight, table.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_tied_head_asked_to_be_quantized_gets_its_own_copy(fmt: LinearFormat) -> None:
    float_model = tiny_model(TINY_QWEN3_CONFIG)
    table = float_model.model.embed_tokens.weight.detach().clone()
    model = apply_weight_format(float_model, "int4", head=fmt)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.format == fmt
    head = model.lm_head.reference_weight()
    assert relative_error(head, table) < {"int8": 0.01, "int4": 0.15}[fmt]
    assert not torch.equal(head, table.to(torch.bfloat16).float()), "the head is quantized"


@pytest.mark.parametrize("int8_dots", [True, False], ids=["int8-dots", "no-int8-dots"])
def test_the_head_is_int8_for_the_quantized_formats_only_on_a_cpu_with_int8_dot_products(
    int8_dots: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`head_format`: bf16 for bf16 everywhere and for every format off a CPU whose int8 head
    multiplies with integer dot products (and on CUDA); int8 for int8 and int4 on one."""
    monkeypatch.setattr(quantized_linear, "INT8_DYNAMIC_HEAD", int8_dots)
    quantized = "int8" if int8_dots else "bf16"
    assert head_format("bf16", CPU) == "bf16"
    assert head_format("int8", CPU) == head_format("int4", CPU) == quantized
    assert head_format("int4", torch.device("cuda")) == "bf16"
    with pytest.raises(ValueError, match="'float32' keeps the head as loaded"):
        head_format("float32", CPU)
    model = apply_weight_format(tiny_model(TINY_QWEN3_CONFIG), "int4")
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.format == quantized


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tied_bf16_head_is_the_bf16_table_itself(
    fmt: WeightFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 head (`head_format`'s choice for bf16, and for every format where an int8 head
    would be no faster): no copy of the table for the head."""
    monkeypatch.setattr(quantized_linear, "INT8_DYNAMIC_HEAD", False)
    model = apply_weight_format(tiny_model(TINY_QWEN3_CONFIG), fmt)
    assert isinstance(model.lm_head, QuantizedLinear)
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == table.data_ptr()
    untied = apply_weight_format(tiny_model(TINY_CONFIG), fmt)
    assert isinstance(untied.lm_head, QuantizedLinear)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_float32_changes_nothing() -> None:
    model = tiny_model(TINY_CONFIG)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    assert apply_weight_format(model, "float32") is model
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_the_dequantized_twin_and_stay_near_float32(
    config: ModelConfig, fmt: WeightFormat
) -> None:
    reference = tiny_model(config, seed=11)
    model = apply_weight_format(tiny_model(config, seed=11), fmt)
    twin = dequantized_twin(model)
    for seed in range(3):
        ids = prompt(seed)
        got = last_logits(model, ids)
        assert relative_error(got, last_logits(twin, ids)) < TWIN_BOUND
        assert relative_error(got, last_logits(reference, ids)) < FLOAT32_BOUND[fmt]


def padded(rows: int) -> int:
    return -(-rows // INT4_CPU_ROWS) * INT4_CPU_ROWS


def test_formats_hold_fewer_bytes_in_order() -> None:
    """Each format's bytes: the bf16 table, the float32 norms, and its layers' buffers (CPU
    int4 rows padded to whole blocks: the tiny model's 32-row k/v, not SmolLM2's), and an int8
    head's copy in fbgemm's layout where it has one (worker/fbgemm_int8.py)."""
    models = {fmt: apply_weight_format(tiny_model(), fmt) for fmt in FORMATS}
    sizes = {fmt: weight_bytes(model) for fmt, model in models.items()}
    sizes["float32"] = weight_bytes(tiny_model())
    assert sizes["float32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"]
    config = TINY_CONFIG
    hidden, vocab, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    matrices = [(config.q_size, hidden), (config.kv_size, hidden), (config.kv_size, hidden)]
    matrices += [(hidden, config.q_size), (inter, hidden), (inter, hidden), (hidden, inter)]
    matrices = matrices * config.num_layers
    promised = {
        "bf16": lambda out, inp: out * inp * 2,
        "int8": lambda out, inp: out * inp + out * 2,  # + a bf16 scale per row
        "int4": lambda out, inp: padded(out) * (inp // 2 + inp // 32 * 4),  # + scale, zero
    }
    fixed = vocab * hidden * 2 + (2 * config.num_layers + 1) * hidden * 4  # table, norms
    for fmt in FORMATS:
        size = promised[fmt]
        head = promised[head_format(fmt, CPU)](vocab, hidden)  # TINY_CONFIG's head is untied
        lm_head = models[fmt].lm_head
        if getattr(lm_head, "fbgemm", None) is not None:  # an int8 head's copy for fbgemm
            head += fbgemm_int8.packed_bytes(lm_head.q)  # type: ignore[union-attr]
        assert sizes[fmt] == fixed + head + sum(size(out, inp) for out, inp in matrices), fmt


SCENARIOS = ["paged-page16", "prefix-hit", "full-prompt-hit-page1", "chunk-7", "crowded-batch"]


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_cache_changes_nothing_within_a_format(config: ModelConfig, fmt: WeightFormat) -> None:
    """The engine, cold and after cache hits, in several chunkings and batches, against the
    no-cache oracle of the same quantized model: the same greedy tokens, and logits equal up to
    the bf16 rounding of the linears' outputs. A row goes through the format's decode kernel in
    a small batch and through float32 GEMM in one of FLOAT32_ROWS rows or more (prefill; int4
    under torch's AVX-512 kernels and bf16 with AVX512-BF16 never, though a one-row bf16 call
    over 1,152 inputs or more sums in another order than a batch): the same sums in another
    order, which can round to
    the neighbouring bf16 value (seen: up to 5e-3 here; 0 when both runs take the same
    paths)."""
    model = apply_weight_format(tiny_model(config, seed=11), fmt)
    tokens, logits = no_cache_greedy(model, equivalence.PROMPT, equivalence.STEPS)
    bound = 2e-2
    for scenario in SCENARIOS:
        engine_config, run = equivalence.SCENARIOS[scenario]
        engine, recorder = recorded_engine(model, engine_config)
        run(engine, recorder.outputs.append)
        assert recorder.tokens("target") == tokens, scenario
        first = recorder.logits[("target", 0, len(equivalence.PROMPT))]
        assert relative_error(first, logits) < bound, scenario
        if "hit" in scenario:
            assert recorder.final("target").cached_prompt_tokens > 0


def forced(runner: ModelRunner, ids: list[int], follow: list[int], slot: int) -> list[torch.Tensor]:
    """Logits of a prefill in two chunks, then of decode steps feeding `follow` (not the argmax:
    two near-equal models may pick different tokens at a near-tie)."""
    pages = list(range(1, 1 + -(-(len(ids) + len(follow)) // 4)))
    split = len(ids) // 2
    runner.run([Chunk(ids[:split], 0, pages, False, slot)])
    logits = [runner.run([Chunk(ids[split:], split, pages, True, slot)])[0]]
    for i, token in enumerate(follow):
        logits.append(runner.run([Chunk([token], len(ids) + i, pages, True, slot)])[0])
    return logits


@pytest.mark.parametrize("fmt", FORMATS)
def test_lora_adds_its_terms_on_a_quantized_base(fmt: WeightFormat) -> None:
    """An adapter on the quantized model equals the adapter merged into the dequantized twin,
    prefill and decode, and moves the logits far more than that difference."""
    model = apply_weight_format(tiny_model(TINY_CONFIG, seed=3), fmt)
    adapter = random_adapter(TINY_CONFIG, "a", rank=6, seed=1)
    twin = dequantized_twin(model)
    with torch.no_grad():
        for (layer, module), (a, b) in adapter.weights.items():
            block = twin.model.layers[layer]
            parent = block.self_attn if module in ATTENTION else block.mlp
            getattr(parent, module).weight += adapter.scaling * b @ a
    stacks = stacks_with(TINY_CONFIG, {1: adapter})
    ids, follow = prompt(5, 21), prompt(6, 3)
    with_adapter = forced(ModelRunner(model, 16, 4, lora=stacks), ids, follow, 1)
    merged = forced(ModelRunner(twin, 16, 4), ids, follow, -1)
    base = forced(ModelRunner(model, 16, 4), ids, follow, -1)
    for got, want, plain in zip(with_adapter, merged, base, strict=True):
        error = relative_error(got, want)
        assert error < TWIN_BOUND
        assert relative_error(plain, want) > 10 * error, "the adapter changed nothing"


def test_given_quantized_weights_are_used_as_they_are() -> None:
    """A GGUF-style int4 weight for one projection, an int8 one for the tied table: the
    projection packed with its own levels and group, the table dequantized from its weight, the
    head that table (or, asked for int4, quantized again from it)."""
    config = TINY_QWEN3_CONFIG
    gen = torch.Generator().manual_seed(9)
    out, inp = config.q_size, config.hidden_size
    q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    given = QuantizedWeight("int4", q, torch.rand(out, 1, generator=gen), torch.zeros(out, 1), 64)
    table = quantize(torch.randn(config.vocab_size, inp, generator=gen) * 0.1, "int8")
    name = "model.layers.1.self_attn.q_proj.weight"
    quantized = {name: given, "model.embed_tokens.weight": table}
    model = apply_weight_format(tiny_model(config), "int4", quantized)
    layer = model.get_submodule("model.layers.1.self_attn.q_proj")
    assert isinstance(layer, QuantizedLinear) and layer.group_size == 64
    assert torch.equal(int4pack_levels(layer.packed, inp)[:out], q)
    assert torch.equal(model.model.embed_tokens.weight, dequantize(table).to(torch.bfloat16))
    assert isinstance(model.lm_head, QuantizedLinear)
    assert model.lm_head.format == head_format("int4", CPU)
    other = apply_weight_format(tiny_model(config), "int4", quantized, head="int4")
    assert isinstance(other.lm_head, QuantizedLinear) and other.lm_head.format == "int4"
    assert relative_error(other.lm_head.reference_weight(), dequantize(table)) < 0.15


def test_bad_requests_are_refused_naming_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="weights: 'fp8' is not one of float32, bf16, int8, int4"):
        apply_weight_format(tiny_model(), "fp8")  # type: ignore[arg-type]
    weight = quantize(torch.randn(64, 64), "int4")
    with pytest.raises(ValueError, match=r"tensors the model does not have: \['nope.weight'\]"):
        apply_weight_format(tiny_model(), "int4", {"nope.weight": weight})
    with pytest.raises(ValueError, match="head: 'fp8' is not one of bf16, int8, int4"):
        apply_weight_format(tiny_model(), "int4", head="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32' keeps the float weights and head"):
        apply_weight_format(tiny_model(), "float32", head="int4")
    with pytest.raises(ValueError, match="float32' keeps the float weights"):
        apply_weight_format(
            tiny_model(), "float32", {f"{linear_names(tiny_model())[0]}.weight": weight}
        )
    model = apply_weight_format(tiny_model(), "int4")
    with pytest.raises(ValueError, match="already holds int4 layers"):
        apply_weight_format(model, "int8")


def test_load_model_gives_each_format_its_own_revision(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "tiny")
    revisions = {}
    for fmt in ["float32", *FORMATS]:
        loaded = load_model(path, weights=fmt)
        revisions[fmt] = loaded.revision
        assert isinstance(loaded.model.lm_head, QuantizedLinear) == (fmt != "float32")
    assert len(set(revisions.values())) == 4
    assert revisions["float32"] == model_revision(path), "float32 keeps its old revision"
    with pytest.raises(ValueError, match="weights: 'q4_0' is not one of"):
        load_model(path, weights="q4_0")  # type: ignore[arg-type]
