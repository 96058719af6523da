"""worker.checkpoint: HF checkpoint directories written here, read back exactly or refused."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    expected_shapes,
    load_checkpoint,
    save_checkpoint,
)
from worker.config import ModelConfig
from worker.loader import load_model
from worker.tiny_model import (
    TINY_CONFIG,
    TINY_QWEN3_CONFIG,
    build_tiny_checkpoint,
    tiny_state_dict,
)

QWEN2_CONFIG = replace(TINY_CONFIG, architecture="qwen2", attention_bias=True, num_layers=1)


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


def test_expected_shapes_cover_every_variant() -> None:
    llama = expected_shapes(TINY_CONFIG)
    assert llama["model.embed_tokens.weight"] == (512, 64)
    assert llama["model.layers.1.self_attn.q_proj.weight"] == (64, 64)
    assert llama["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert llama["model.layers.0.mlp.down_proj.weight"] == (64, 128)
    assert llama["lm_head.weight"] == (512, 64)
    assert not any("norm.weight" in n and "self_attn" in n for n in llama)
    assert len(llama) == 2 + 9 * 2 + 1
    qwen3 = expected_shapes(TINY_QWEN3_CONFIG)
    assert "lm_head.weight" not in qwen3
    assert qwen3["model.layers.0.self_attn.q_proj.weight"] == (128, 64)
    assert qwen3["model.layers.0.self_attn.o_proj.weight"] == (64, 128)
    assert qwen3["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert qwen3["model.layers.0.self_attn.k_norm.weight"] == (16,)
    qwen2 = expected_shapes(QWEN2_CONFIG)
    assert qwen2["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2


@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_QWEN3_CONFIG, QWEN2_CONFIG], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_single_file(tmp_path: Path, config: ModelConfig, dtype: torch.dtype) -> None:
    state = {k: v.to(dtype) for k, v in tiny_state_dict(config, seed=3).items()}
    save_checkpoint(tmp_path, config, state)
    assert (tmp_path / SINGLE_FILE).is_file()
    assert not (tmp_path / INDEX_FILE).exists()
    loaded_config, loaded = load_checkpoint(tmp_path)
    assert loaded_config == replace(config, dtype=str(dtype).removeprefix("torch."))
    _assert_same(loaded, state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_sharded(tmp_path: Path, dtype: torch.dtype) -> None:
    state = {k: v.to(dtype) for k, v in tiny_state_dict(TINY_CONFIG, seed=4).items()}
    save_checkpoint(tmp_path, TINY_CONFIG, state, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / SINGLE_FILE).exists()
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    _, loaded = load_checkpoint(tmp_path)
    _assert_same(loaded, state)


def test_cast_on_load(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG, seed=5)
    save_checkpoint(tmp_path, TINY_CONFIG, state)
    config, loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert config.dtype == "bfloat16"
    _assert_same(loaded, {k: v.to(torch.bfloat16) for k, v in state.items()})
    with pytest.raises(CheckpointError, match="int8"):
        load_checkpoint(tmp_path, dtype=torch.int8)


def test_same_inputs_same_bytes(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG, seed=6)
    for name in ("a", "b"):
        save_checkpoint(tmp_path / name, TINY_CONFIG, state, max_shard_bytes=50_000)
    for file in (tmp_path / "a").iterdir():
        assert file.read_bytes() == (tmp_path / "b" / file.name).read_bytes(), file.name


def test_tied_head_copy_and_rotary_buffers_are_dropped(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_QWEN3_CONFIG, seed=7)
    save_checkpoint(tmp_path, TINY_QWEN3_CONFIG, state)
    extra = dict(state)
    extra["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(extra, str(tmp_path / SINGLE_FILE))
    _, loaded = load_checkpoint(tmp_path)
    _assert_same(loaded, state)


def test_missing_config(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, TINY_CONFIG, tiny_state_dict(TINY_CONFIG))
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_checkpoint(tmp_path)


def test_unreadable_config(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, TINY_CONFIG, tiny_state_dict(TINY_CONFIG))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(CheckpointError, match="num_attention_heads"):
        load_checkpoint(tmp_path)


def test_missing_weights_file(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, TINY_CONFIG, tiny_state_dict(TINY_CONFIG))
    (tmp_path / SINGLE_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors nor"):
        load_checkpoint(tmp_path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG)
    save_checkpoint(tmp_path, TINY_CONFIG, state)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / SINGLE_FILE))
    with pytest.raises(
        CheckpointError, match=r"1 missing tensor\(s\): model\.layers\.1\.mlp\.up_proj"
    ):
        load_checkpoint(tmp_path)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG)
    save_checkpoint(tmp_path, TINY_CONFIG, state)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(state, str(tmp_path / SINGLE_FILE))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(tmp_path)
    assert "model.layers.0.self_attn.k_proj.weight is (64, 64), expected (32, 64)" in str(
        error.value
    )


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG)
    save_checkpoint(tmp_path, TINY_CONFIG, state)
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(state, str(tmp_path / SINGLE_FILE))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): model\.layers\.2\.mlp"):
        load_checkpoint(tmp_path)


def test_missing_shard_and_short_shard_are_named(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG)
    save_checkpoint(tmp_path, TINY_CONFIG, state, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    first = index["weight_map"]["model.embed_tokens.weight"]
    last = index["weight_map"]["lm_head.weight"]
    (tmp_path / last).unlink()
    with pytest.raises(CheckpointError, match=f"weight file .*{last} is missing"):
        load_checkpoint(tmp_path)
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / last))
    with pytest.raises(CheckpointError, match=f"{last} lacks 1 tensor.*lm_head.weight"):
        load_checkpoint(tmp_path)
    assert first != last


def test_integer_weights_are_refused(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG)
    save_checkpoint(tmp_path, TINY_CONFIG, state)
    state["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(state, str(tmp_path / SINGLE_FILE))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight .* is torch\.int32"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "value,stored,dtype",
    [(float("nan"), torch.float32, None), (float("-inf"), torch.float32, None),
     (float("nan"), torch.bfloat16, None), (1e6, torch.float32, torch.float16)],
    ids=["nan", "inf", "bf16-nan", "overflows-float16"],
)  # fmt: skip
def test_a_non_finite_weight_is_refused_naming_the_tensor_and_the_file(
    tmp_path: Path, value: float, stored: torch.dtype, dtype: torch.dtype | None
) -> None:
    """A NaN or infinite weight (stored, or made by the dtype asked for: 1e6 is inf in
    float16) is refused with the tensor and the file named, as a LoRA adapter's is: it loaded
    before, and every answer was token 0."""
    state = {name: t.to(stored) for name, t in tiny_state_dict(TINY_CONFIG).items()}
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    save_checkpoint(tmp_path, TINY_CONFIG, state)
    cast = "" if dtype is None else " as float16"
    with pytest.raises(
        CheckpointError,
        match=rf"model\.layers\.1\.mlp\.down_proj\.weight in {re.escape(str(tmp_path))}/"
        rf"model\.safetensors holds 1 NaN or infinite value\(s\){cast}$",
    ):
        load_model(tmp_path, dtype=dtype)


def test_finite_weights_whose_sum_overflows_still_load(tmp_path: Path) -> None:
    """The check sums each tensor first (a NaN or an infinity makes the sum so); finite
    float16 weights whose sum passes float16's range are counted exactly and load."""
    state = {name: t.half() for name, t in tiny_state_dict(TINY_CONFIG).items()}
    state["model.norm.weight"] = torch.full((64,), 60_000.0, dtype=torch.float16)
    save_checkpoint(tmp_path, TINY_CONFIG, state)
    _, loaded = load_checkpoint(tmp_path)
    assert torch.equal(loaded["model.norm.weight"], state["model.norm.weight"])


@pytest.mark.parametrize(
    "name,content,why",
    [("config.json", b"\xff\xfe{}", "is not valid JSON"),
     (INDEX_FILE, b"\xff", "has no usable weight_map"),
     (INDEX_FILE, b'{"weight_map": ["model.safetensors"]}', "weight_map must map"),
     (INDEX_FILE, b'{"weight_map": {"model.norm.weight": 3}}', "weight_map must map")],
    ids=["config-not-utf8", "index-not-utf8", "index-map-a-list", "index-file-not-a-name"],
)  # fmt: skip
def test_a_checkpoint_file_that_cannot_be_read_is_named(
    tmp_path: Path, name: str, content: bytes, why: str
) -> None:
    """config.json or the shard index holding bytes that are not UTF-8, or an index whose
    weight_map is not names to file names, is a CheckpointError naming the file: before, a
    bare UnicodeDecodeError or AttributeError said neither which file nor what was wrong."""
    directory = build_tiny_checkpoint(tmp_path / "m")
    (directory / name).write_bytes(content)
    with pytest.raises(CheckpointError, match=f"{re.escape(str(directory / name))}:? {why}"):
        load_model(directory)


def test_save_refuses_a_state_dict_that_would_not_load(tmp_path: Path) -> None:
    state = tiny_state_dict(TINY_CONFIG)
    del state["model.norm.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model\.norm\.weight"):
        save_checkpoint(tmp_path, TINY_CONFIG, state)
    assert not (tmp_path / SINGLE_FILE).exists()
