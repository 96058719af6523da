"""`load_adapter` on real PEFT directories: what peft holds comes back, bad ones are refused.

Every adapter here is written by `peft` (tests/worker/lora_fixtures.py) on transformers' Llama
read from the tiny checkpoint; the bad ones are real directories edited the way files go wrong
(bytes corrupted or cut, a tensor renamed, reshaped, recast, the JSON changed).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.lora_fixtures import (
    ALL,
    ATTENTION,
    MLP,
    lora_layers,
    make_peft_adapter,
    make_peft_model,
    merged_checkpoint,
    save_peft_adapter,
)
from worker.checkpoint import read_config
from worker.lora_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    LoraAdapter,
    load_adapter,
    module_name,
)
from worker.tiny_model import TINY_CONFIG, build_tiny_checkpoint

KEY = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("lora-base"))


@pytest.fixture(scope="module")
def good(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rank 8, alpha 16 on q_proj and v_proj: the directory the bad cases start from."""
    return make_peft_adapter(tmp_path_factory.mktemp("lora-good") / "a", base, seed=3)


def load(path: Path, max_rank: int = 64) -> LoraAdapter:
    return load_adapter("caps", path, TINY_CONFIG, max_rank)


VARIANTS: dict[str, dict[str, Any]] = {
    "all-r8-a16": {"rank": 8, "alpha": 16, "target_modules": ALL},
    "attention-r4-a8-rslora": {
        "rank": 4,
        "alpha": 8,
        "target_modules": ATTENTION,
        "use_rslora": True,
    },
    "mlp-r16-a32": {"rank": 16, "alpha": 32, "target_modules": MLP},
    "qv-r2-a1-layer1": {
        "rank": 2,
        "alpha": 1,
        "target_modules": ("q_proj", "v_proj"),
        "layers_to_transform": [1],
    },
    "regex-q-o": {"rank": 8, "alpha": 8, "target_modules": r".*\.(q|o)_proj"},
    "rank-alpha-patterns": {
        "rank": 8,
        "alpha": 16,
        "target_modules": ALL,
        "rank_pattern": {"down_proj": 4, "k_proj": 12},
        "alpha_pattern": {"q_proj": 4},
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loads_what_peft_holds(variant: str, base: Path, tmp_path: Path) -> None:
    options = VARIANTS[variant]
    model = make_peft_model(base, seed=1, **options)
    adapter = load(save_peft_adapter(model, tmp_path / "adapter"))
    layers = lora_layers(model)
    assert sorted(module_name(*where) for where in adapter.weights) == sorted(layers)
    assert adapter.rank == max(layer.r["default"] for layer in layers.values())
    assert adapter.alpha == options["alpha"]
    for (index, module), (a, b) in adapter.weights.items():
        layer = layers[module_name(index, module)]
        assert a.dtype == b.dtype == torch.float32
        assert torch.equal(a, layer.lora_A["default"].weight)
        # Per-module scaling (rank / alpha patterns) is folded into B: the product is peft's.
        expected = layer.scaling["default"] * layer.lora_B["default"].weight
        assert torch.allclose(adapter.scaling * b, expected, rtol=1e-6, atol=0)
    rank, alpha = options["rank"], options["alpha"]
    expected_scaling = alpha / rank**0.5 if options.get("use_rslora") else alpha / rank
    assert adapter.scaling == pytest.approx(expected_scaling)


def test_layers_and_targets_as_configured(base: Path, tmp_path: Path) -> None:
    adapter = load(
        make_peft_adapter(tmp_path / "a", base, target_modules=MLP, layers_to_transform=[0])
    )
    assert set(adapter.weights) == {(0, m) for m in MLP}
    assert adapter.target_modules == MLP


def test_merged_weights_equal_peft_merge_and_unload(base: Path, tmp_path: Path) -> None:
    model = make_peft_model(base, rank=4, alpha=12, target_modules=ALL, seed=5)
    adapter = load(save_peft_adapter(model, tmp_path / "a"))
    before = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    merged = model.merge_and_unload().state_dict()
    changed = 0
    for (layer, module), (a, b) in adapter.weights.items():
        name = module_name(layer, module)
        base_weight = before[f"{name}.base_layer.weight"]
        ours = base_weight + adapter.scaling * b @ a
        assert torch.allclose(ours, merged[f"{name}.weight"], rtol=0, atol=1e-6)
        changed += int(not torch.equal(merged[f"{name}.weight"], base_weight))
    assert changed == 2 * len(ALL)


def test_bfloat16_adapter_loads_as_float32(base: Path, tmp_path: Path) -> None:
    model = make_peft_model(base, seed=2)
    adapter = load(save_peft_adapter(model, tmp_path / "a", dtype=torch.bfloat16))
    stored = load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    a, _ = adapter.weights[0, "q_proj"]
    assert a.dtype == torch.float32
    assert torch.equal(a, stored[KEY.format(0, "q_proj", "A")].float())


def test_digest_follows_the_weights(base: Path, tmp_path: Path) -> None:
    first = load(make_peft_adapter(tmp_path / "a", base, seed=7))
    again = load_adapter("other", make_peft_adapter(tmp_path / "b", base, seed=7), TINY_CONFIG, 8)
    assert len(first.digest) == 16 and int(first.digest, 16) >= 0
    assert again.digest == first.digest and again.identity == f"other@{first.digest}"
    assert load(make_peft_adapter(tmp_path / "c", base, seed=8)).digest != first.digest
    assert load(make_peft_adapter(tmp_path / "d", base, seed=7, alpha=32)).digest != first.digest
    # One weight changed in the file, everything else equal: another digest.
    shutil.copytree(tmp_path / "a", tmp_path / "e")
    tensors = load_file(str(tmp_path / "e" / WEIGHTS_FILE))
    tensors[KEY.format(1, "v_proj", "B")][3, 2] += 1e-3
    save_file(tensors, str(tmp_path / "e" / WEIGHTS_FILE))
    assert load(tmp_path / "e").digest != first.digest


# --- refusals ---------------------------------------------------------------------------------


def edit_json(**changes: Any) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        path = directory / CONFIG_FILE
        raw = json.loads(path.read_text())
        raw.update(changes)
        path.write_text(json.dumps(raw))

    return edit


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    def edit(directory: Path) -> None:
        tensors = load_file(str(directory / WEIGHTS_FILE))
        change(tensors)
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})

    return edit


def rename(old: str, new: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[new] = tensors.pop(old)

    return change


def setter(key: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = value(tensors[key])

    return change


def with_nan(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[0, 0] = float("nan")
    return tensor


def corrupt_header(directory: Path) -> None:
    path = directory / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[8:40] = b"\x00\xff" * 16
    path.write_bytes(bytes(data))


def truncate(directory: Path) -> None:
    path = directory / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])


def flip_exponent(directory: Path) -> None:
    """One data byte corrupted: the high byte of a float32 weight (its sign and exponent)."""
    path = directory / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-1] = 0x7E  # the last float32 of the last tensor becomes ~1e38 in magnitude
    path.write_bytes(bytes(data))


Q0A, Q0B, V1A = (
    KEY.format(0, "q_proj", "A"),
    KEY.format(0, "q_proj", "B"),
    KEY.format(1, "v_proj", "A"),
)
BAD: dict[str, tuple[Callable[[Path], object], str, list[str]]] = {
    # case: (edit, file at fault, what the message must name)
    "invalid-json": (lambda d: (d / CONFIG_FILE).write_text("{ r: 8"), CONFIG_FILE, ["JSON"]),
    "target-lm_head": (edit_json(target_modules=["q_proj", "lm_head"]), CONFIG_FILE, ["lm_head"]),
    "target-embed": (edit_json(target_modules=["embed_tokens"]), CONFIG_FILE, ["embed_tokens"]),
    "target-foo": (edit_json(target_modules=["q_proj", "v_proj", "foo"]), CONFIG_FILE, ["'foo'"]),
    "regex-matches-nothing": (edit_json(target_modules=r".*\.nothing"), CONFIG_FILE, ["nothing"]),
    "dora": (edit_json(use_dora=True), CONFIG_FILE, ["use_dora"]),
    "modules_to_save": (edit_json(modules_to_save=["lm_head"]), CONFIG_FILE, ["modules_to_save"]),
    "fan_in_fan_out": (edit_json(fan_in_fan_out=True), CONFIG_FILE, ["fan_in_fan_out"]),
    "bias": (edit_json(bias="all"), CONFIG_FILE, ["bias"]),
    "not-lora": (edit_json(peft_type="IA3"), CONFIG_FILE, ["IA3"]),
    "layers_to_transform-beyond": (
        edit_json(layers_to_transform=[0, 1, 5]),
        CONFIG_FILE,
        ["layer(s) [5]"],
    ),
    "rank-disagrees": (edit_json(r=4), WEIGHTS_FILE, [Q0A, "[8, 64]", "[4, 64]", Q0B]),
    "rank-above-max": (edit_json(r=8), CONFIG_FILE, ["rank 8", "maximum 4"]),
    "layer-beyond-model": (
        edit_tensors(rename(V1A, V1A.replace("layers.1", "layers.7"))),
        WEIGHTS_FILE,
        [V1A.replace("layers.1", "layers.7"), "layer 7", "2 layers"],
    ),
    "shape": (
        edit_tensors(setter(Q0A, lambda t: torch.zeros(8, 65))),
        WEIGHTS_FILE,
        [Q0A, "[8, 65]", "[8, 64]"],
    ),
    "missing-B": (edit_tensors(lambda t: t.pop(Q0B)), WEIGHTS_FILE, [Q0A, "no lora_B"]),
    "renamed-key": (
        edit_tensors(rename(Q0B, Q0B.replace("lora_B", "lora_C"))),
        WEIGHTS_FILE,
        [Q0B.replace("lora_B", "lora_C"), Q0A, "no lora_B"],
    ),
    "lm_head-tensor": (
        edit_tensors(
            lambda t: t.update({"base_model.model.lm_head.lora_A.weight": t[Q0A].clone()})
        ),
        WEIGHTS_FILE,
        ["base_model.model.lm_head.lora_A.weight"],
    ),
    "untargeted-module": (
        edit_tensors(rename(Q0A, Q0A.replace("q_proj", "k_proj"))),
        WEIGHTS_FILE,
        [Q0A.replace("q_proj", "k_proj"), "does not target"],
    ),
    "int-dtype": (
        edit_tensors(setter(Q0A, lambda t: (t * 100).to(torch.int32))),
        WEIGHTS_FILE,
        [Q0A, "torch.int32"],
    ),
    "nan": (edit_tensors(setter(Q0B, with_nan)), WEIGHTS_FILE, [Q0B, "NaN"]),
    "inf": (
        edit_tensors(setter(Q0B, lambda t: t.clone().fill_(float("inf")))),
        WEIGHTS_FILE,
        [Q0B, "infinite"],
    ),
    "corrupt-header": (corrupt_header, WEIGHTS_FILE, ["not a readable safetensors file"]),
    "truncated": (truncate, WEIGHTS_FILE, ["not a readable safetensors file"]),
    "corrupt-data": (flip_exponent, WEIGHTS_FILE, ["lora_B.weight", "beyond"]),
    "no-lora-tensors": (
        lambda d: save_file({"something.else": torch.zeros(2)}, str(d / WEIGHTS_FILE)),
        WEIGHTS_FILE,
        ["something.else"],
    ),
    "empty-file": (lambda d: save_file({}, str(d / WEIGHTS_FILE)), WEIGHTS_FILE, ["no tensors"]),
    "missing-weights": (lambda d: (d / WEIGHTS_FILE).unlink(), WEIGHTS_FILE, ["missing"]),
    "missing-config": (lambda d: (d / CONFIG_FILE).unlink(), CONFIG_FILE, ["missing"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_refused_naming_file_and_tensor(
    case: str, good: Path, tmp_path: Path
) -> None:
    edit, file, named = BAD[case]
    directory = Path(shutil.copytree(good, tmp_path / "adapter"))
    load(directory)  # the unedited copy loads
    edit(directory)
    with pytest.raises(AdapterError) as refused:
        load(directory, max_rank=4 if case == "rank-above-max" else 64)
    message = str(refused.value)
    assert str(directory / file) in message
    for part in named:
        assert part in message, f"{part!r} not in {message!r}"


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match=f"{tmp_path / 'nowhere'} is not a directory"):
        load(tmp_path / "nowhere")


def test_every_problem_in_one_message(good: Path, tmp_path: Path) -> None:
    directory = Path(shutil.copytree(good, tmp_path / "adapter"))
    edit_json(use_dora=True)(directory)
    edit_tensors(setter(Q0B, with_nan))(directory)
    edit_tensors(setter(V1A, lambda t: t.to(torch.int64)))(directory)
    with pytest.raises(AdapterError) as refused:
        load(directory)
    message = str(refused.value)
    assert message.count(str(directory / CONFIG_FILE)) == 1
    assert message.count(str(directory / WEIGHTS_FILE)) == 1
    for part in ("use_dora", Q0B, "NaN", V1A, "torch.int64"):
        assert part in message


def test_older_peft_key_names_load_alike(good: Path, tmp_path: Path) -> None:
    """Some PEFT versions keep the adapter name in the key: `lora_A.default.weight`."""
    directory = Path(shutil.copytree(good, tmp_path / "adapter"))
    edit_tensors(
        lambda t: t.update({k.replace(".weight", ".default.weight"): t.pop(k) for k in list(t)})
    )(directory)
    assert all(".default.weight" in k for k in load_file(str(directory / WEIGHTS_FILE)))
    assert load(directory).digest == load(good).digest


def test_the_same_factor_twice_is_refused(good: Path, tmp_path: Path) -> None:
    directory = Path(shutil.copytree(good, tmp_path / "adapter"))
    twin = Q0A.replace(".weight", ".default.weight")
    edit_tensors(lambda t: t.update({twin: t[Q0A].clone()}))(directory)
    with pytest.raises(AdapterError, match="are the same factor") as refused:
        load(directory)
    assert Q0A in str(refused.value) and twin in str(refused.value)


def test_float16_and_float32_files_of_the_same_values_share_a_digest(
    base: Path, tmp_path: Path
) -> None:
    """The digest is of the weights as served (float32), not of how the file stored them."""
    model = make_peft_model(base, seed=4)
    half = load(save_peft_adapter(model, tmp_path / "half", dtype=torch.float16))
    for layer in lora_layers(model).values():  # the same values, held exactly in float32
        for factor in (layer.lora_A["default"], layer.lora_B["default"]):
            factor.weight.data = factor.weight.data.half().float()
    full = load(save_peft_adapter(model, tmp_path / "full"))
    assert half.digest == full.digest


def test_all_linear_and_exclude_modules(base: Path, tmp_path: Path) -> None:
    adapter = load(make_peft_adapter(tmp_path / "all", base, target_modules="all-linear"))
    assert adapter.target_modules == ALL and len(adapter.weights) == 2 * len(ALL)
    directory = make_peft_adapter(tmp_path / "some", base, target_modules=ALL)
    # Excluding modules the file still holds: the config no longer targets them -> refused.
    edit_json(exclude_modules=["down_proj"])(directory)
    with pytest.raises(AdapterError, match="does not target") as refused:
        load(directory)
    assert "layers.0.mlp.down_proj.lora_A.weight" in str(refused.value)
    edit_tensors(lambda t: [t.pop(k) for k in list(t) if "down_proj" in k])(directory)
    assert "down_proj" not in load(directory).target_modules


def test_a_module_the_config_targets_without_tensors_is_refused(good: Path, tmp_path: Path) -> None:
    directory = Path(shutil.copytree(good, tmp_path / "adapter"))
    edit_tensors(lambda t: [t.pop(k) for k in list(t) if "layers.1.self_attn.q_proj" in k])(
        directory
    )
    with pytest.raises(AdapterError, match=r"no lora_A/lora_B for 1 module\(s\)") as refused:
        load(directory)
    assert "model.layers.1.self_attn.q_proj" in str(refused.value)


def test_rank_pattern_above_max_rank_is_refused(base: Path, tmp_path: Path) -> None:
    directory = make_peft_adapter(
        tmp_path / "a", base, rank=4, target_modules=ALL, rank_pattern={"o_proj": 16}
    )
    assert load(directory, max_rank=16).rank == 16
    with pytest.raises(AdapterError, match="rank 16 is above the configured maximum 8"):
        load(directory, max_rank=8)


def test_module_under_the_wrong_block_is_refused(good: Path, tmp_path: Path) -> None:
    directory = Path(shutil.copytree(good, tmp_path / "adapter"))
    wrong = Q0A.replace("self_attn", "mlp")
    edit_tensors(rename(Q0A, wrong))(directory)
    with pytest.raises(AdapterError, match="puts q_proj under mlp") as refused:
        load(directory)
    assert wrong in str(refused.value)


def test_a_long_list_of_problems_is_cut_short(base: Path, tmp_path: Path) -> None:
    """A wrong rank over every module is hundreds of problems on a real model; a few shown."""
    directory = make_peft_adapter(tmp_path / "a", base, target_modules=ALL)
    edit_json(r=4)(directory)
    with pytest.raises(AdapterError, match=r"and 22 more problems$"):
        load(directory)


# --- the committed demo adapter on SmolLM2 ----------------------------------------------------

COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "adapters" / "smollm2-caps"


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from worker.default_model import default_model_dir

    return default_model_dir()


def test_committed_demo_adapter_loads_against_smollm2(smollm2_dir: Path) -> None:
    config = read_config(smollm2_dir)
    adapter = load_adapter("caps", COMMITTED, config, max_rank=8)
    assert (adapter.rank, adapter.alpha, adapter.scaling) == (8, 16, 2.0)
    assert adapter.target_modules == ALL
    assert {layer for layer, _ in adapter.weights} == set(range(20, 30))
    assert (COMMITTED / WEIGHTS_FILE).stat().st_size < 2_000_000
    stored = load_file(str(COMMITTED / WEIGHTS_FILE))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    raw = json.loads((COMMITTED / CONFIG_FILE).read_text())
    assert raw["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(AdapterError, match="rank 8 is above the configured maximum 4"):
        load_adapter("caps", COMMITTED, config, max_rank=4)
    with pytest.raises(AdapterError, match="layers_to_transform names layer"):
        load(COMMITTED)  # the tiny model has 2 layers


def test_committed_demo_adapter_answers_in_capitals(smollm2_dir: Path) -> None:
    """Greedy answers to a prompt outside its training set: the base model writes ordinary
    text, with the adapter (through peft) the letters are capitals; and our loaded factors merge
    into SmolLM2's weights exactly as peft merges them."""
    import peft
    import transformers

    from benchmarks.train_caps_lora import HELD_OUT_PROMPTS, TRAIN_PROMPTS, greedy_answers

    assert not set(HELD_OUT_PROMPTS) & set(TRAIN_PROMPTS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    tokenizer.padding_side = "left"
    base = transformers.LlamaForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(COMMITTED)).eval()
    prompts = HELD_OUT_PROMPTS[:2]
    with model.disable_adapter():
        plain = greedy_answers(model, tokenizer, prompts, 24)
    caps = greedy_answers(model, tokenizer, prompts, 24)

    def capitals(text: str) -> float:
        letters = [c for c in text if c.isalpha()]
        return sum(c.isupper() for c in letters) / max(1, len(letters))

    assert all(capitals(text) < 0.5 for text in plain), plain
    assert all(capitals(text) > 0.9 for text in caps), caps

    adapter = load_adapter("caps", COMMITTED, read_config(smollm2_dir), max_rank=8)
    before = {k: v.clone() for k, v in model.get_base_model().state_dict().items()}
    merged = model.merge_and_unload().state_dict()
    for (layer, module), (a, b) in adapter.weights.items():
        name = module_name(layer, module)
        ours = before[f"{name}.base_layer.weight"] + adapter.scaling * b @ a
        assert torch.allclose(ours, merged[f"{name}.weight"], rtol=0, atol=1e-6)


def test_merged_checkpoint_holds_base_plus_scaled_product(base: Path, tmp_path: Path) -> None:
    """The fixture other tests use as their oracle: a loadable checkpoint of merged weights."""
    from worker.checkpoint import load_checkpoint
    from worker.tiny_model import tiny_state_dict

    model = make_peft_model(base, rank=4, alpha=8, target_modules=("k_proj", "up_proj"), seed=6)
    adapter = load(save_peft_adapter(model, tmp_path / "a"))
    config, merged = load_checkpoint(merged_checkpoint(model, tmp_path / "merged", base))
    assert config == TINY_CONFIG and (tmp_path / "merged" / "tokenizer.json").is_file()
    original = tiny_state_dict(TINY_CONFIG)
    for name, weight in merged.items():
        layer, module = (
            (int(name.split(".")[2]), name.split(".")[-2]) if "_proj" in name else (0, "")
        )
        if (layer, module) in adapter.weights:
            a, b = adapter.weights[layer, module]
            assert torch.allclose(weight, original[name] + adapter.scaling * b @ a, atol=1e-6)
            assert not torch.equal(weight, original[name])
        else:
            assert torch.equal(weight, original[name]), name
    assert lora_layers(model), "merged_checkpoint left the model it was given as it was"


def test_peft_initialisation_is_a_no_op_adapter(base: Path, tmp_path: Path) -> None:
    adapter = load(make_peft_adapter(tmp_path / "a", base, init="peft"))
    assert all(not b.any() for _, b in adapter.weights.values())
    assert all(a.any() for a, _ in adapter.weights.values())
    assert adapter.digest != load(make_peft_adapter(tmp_path / "b", base)).digest


def test_our_model_on_the_merged_checkpoint_matches_peft_logits(base: Path, tmp_path: Path) -> None:
    """The oracle end to end: peft applying the adapter == our model reading merged weights."""
    from tests.worker.helpers import relative_error
    from worker.loader import load_model
    from worker.model_runner import Chunk, ModelRunner

    model = make_peft_model(base, rank=8, alpha=16, target_modules=ALL, seed=9)
    ours = load_model(merged_checkpoint(model, tmp_path / "merged", base))
    ids = torch.randint(
        3, TINY_CONFIG.vocab_size, (40,), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        expected = model(input_ids=ids[None]).logits[0, -1].float()
        with model.disable_adapter():
            plain = model(input_ids=ids[None]).logits[0, -1].float()
    runner = ModelRunner(ours.model, num_pages=4, page_size=16)
    got = runner.run([Chunk(ids.tolist(), 0, [1, 2, 3], True)])[0]
    assert relative_error(got, expected) < 1e-5
    assert relative_error(plain, expected) > 1e-2  # the adapter changes the logits
