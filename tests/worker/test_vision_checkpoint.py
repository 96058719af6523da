"""Loading Idefics3 / SmolVLM directories: every tensor checked, bad ones named, text as before.

The expected tensor names and shapes are compared with transformers' own model of the same
config (built on the meta device: no memory), for the tiny checkpoint and for SmolVLM-256M's
shape, so a naming slip on either side of the rename (`model.text_model.*` -> `model.*`) shows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from xxhash import xxh3_128_hexdigest

from tests.worker.vlm_fixtures import build_tiny_vlm, smolvlm_256m_config, tiny_vlm_config
from worker.checkpoint import CheckpointError, load_checkpoint
from worker.loader import load_model, model_revision
from worker.tiny_model import build_tiny_checkpoint
from worker.vision_checkpoint import is_vision_checkpoint, load_vlm_checkpoint, vlm_expected_shapes
from worker.vision_config import VlmConfig
from worker.vision_model import full_tile_position_ids

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny", seed=1)


@pytest.fixture
def checkpoint(pristine: Path, tmp_path: Path) -> Path:
    """A copy of the tiny checkpoint that a test may spoil."""
    return Path(shutil.copytree(pristine, tmp_path / "copy"))


def _edit_weights(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    state = load_file(str(path / WEIGHTS))
    for name, tensor in edit.items():
        if tensor is None:
            del state[name]
        else:
            state[name] = tensor
    save_file(state, str(path / WEIGHTS), metadata={"format": "pt"})


def _edit_json(path: Path, name: str, **changes: object) -> None:
    data = json.loads((path / name).read_text())
    data.update(changes)
    (path / name).write_text(json.dumps(data))


@pytest.mark.parametrize(
    "config",
    [tiny_vlm_config, lambda: tiny_vlm_config(tie_word_embeddings=True), smolvlm_256m_config],
    ids=["tiny", "tiny-tied", "smolvlm-256m"],
)
def test_expected_shapes_are_transformers_parameters(config: object) -> None:
    hf_config = config()  # type: ignore[operator]
    with torch.device("meta"):
        model = transformers.Idefics3ForConditionalGeneration(hf_config)
    theirs = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: listed once
    ours = vlm_expected_shapes(VlmConfig.from_hf(hf_config.to_dict()))
    assert ours == theirs


def test_smolvlm_256m_shape() -> None:
    config = VlmConfig.from_hf(smolvlm_256m_config().to_dict())
    assert config.image_seq_len == 64 and config.vision.patches_per_side == 32
    assert (config.text.hidden_size, config.text.num_layers, config.text.vocab_size) == (
        576,
        30,
        49280,
    )
    assert config.text.rope_theta == 100000.0
    total = sum(torch.Size(s).numel() for s in vlm_expected_shapes(config).values())
    assert 250e6 < total < 262e6  # "256M"
    assert torch.equal(full_tile_position_ids(32), torch.arange(1024))


def test_checkpoint_splits_into_text_and_vision(pristine: Path) -> None:
    assert is_vision_checkpoint(pristine)
    loaded = load_vlm_checkpoint(pristine)
    assert (
        "model.embed_tokens.weight" in loaded.text_state and "lm_head.weight" in loaded.text_state
    )
    assert not any(name.startswith("model.text_model") for name in loaded.text_state)
    assert "connector.modality_projection.proj.weight" in loaded.vision_state
    assert all(n.startswith(("vision_model.", "connector.")) for n in loaded.vision_state)
    assert loaded.config.text.rope_theta == 100000.0  # read from transformers 5's rope_parameters
    assert (loaded.spec.tile_size, loaded.spec.image_seq_len, loaded.spec.longest_edge) == (
        32,
        4,
        64,
    )
    assert torch.equal(full_tile_position_ids(4), torch.arange(16))


def test_missing_vision_tensor_is_named(checkpoint: Path) -> None:
    _edit_weights(checkpoint, {"model.vision_model.encoder.layers.1.mlp.fc2.bias": None})
    with pytest.raises(
        CheckpointError,
        match=r"1 missing tensor\(s\): model\.vision_model\.encoder\.layers\.1\.mlp\.fc2\.bias",
    ):
        load_model(checkpoint)


def test_misshapen_connector_is_named(checkpoint: Path) -> None:
    _edit_weights(
        checkpoint, {"model.connector.modality_projection.proj.weight": torch.zeros(64, 32)}
    )
    with pytest.raises(
        CheckpointError,
        match=r"model\.connector\.modality_projection\.proj\.weight is \(64, 32\), "
        r"expected \(64, 128\)",
    ):
        load_model(checkpoint)


def test_unexpected_and_missing_text_tensors_are_named(checkpoint: Path) -> None:
    _edit_weights(
        checkpoint,
        {
            "model.text_model.layers.1.mlp.up_proj.weight": None,
            "lm_head.weight": None,
            "model.vision_model.extra.weight": torch.zeros(2),
        },
    )
    with pytest.raises(CheckpointError) as raised:
        load_model(checkpoint)
    message = str(raised.value)
    assert "2 missing tensor(s): model.text_model.layers.1.mlp.up_proj.weight, lm_head.weight" in (
        message
    )
    assert "1 unexpected tensor(s): model.vision_model.extra.weight" in message


def test_processor_that_does_not_fit_the_model_is_refused(checkpoint: Path) -> None:
    _edit_json(checkpoint, "processor_config.json", image_seq_len=9)
    with pytest.raises(CheckpointError, match="image_seq_len is 9, the model's is 4"):
        load_model(checkpoint)
    _edit_json(checkpoint, "processor_config.json", image_seq_len=4)
    _edit_json(checkpoint, "preprocessor_config.json", max_image_size={"longest_edge": 64})
    with pytest.raises(CheckpointError, match=r"\(tile\) is 64, the model's is 32"):
        load_model(checkpoint)
    (checkpoint / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"preprocessor_config\.json is missing"):
        load_model(checkpoint)


def test_bad_config_is_refused(checkpoint: Path) -> None:
    _edit_json(checkpoint, "config.json", scale_factor=3)
    with pytest.raises(CheckpointError, match="scale_factor 3 does not divide the 4 patches"):
        load_model(checkpoint)
    _edit_json(checkpoint, "config.json", scale_factor=2, image_token_id=10_000)
    with pytest.raises(CheckpointError, match="image_token_id 10000 is outside"):
        load_model(checkpoint)
    _edit_json(checkpoint, "config.json", image_token_id=3)  # in the vocabulary, not <image>
    with pytest.raises(
        CheckpointError, match="image_token_id is 3, but the tokenizer's <image> is"
    ):
        load_model(checkpoint)


def test_text_loader_points_a_vision_checkpoint_to_load_model(pristine: Path) -> None:
    with pytest.raises(CheckpointError, match="Idefics3 vision-language checkpoint"):
        load_checkpoint(pristine)


def test_revision_covers_the_processor_settings(checkpoint: Path) -> None:
    before = model_revision(checkpoint)
    _edit_json(checkpoint, "preprocessor_config.json", size={"longest_edge": 96})
    after = model_revision(checkpoint)
    assert before != after
    assert load_model(checkpoint).revision == after


def test_text_models_have_no_vision_and_no_processor_in_their_revision(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "text", seed=2)
    loaded = load_model(path)
    assert loaded.vision is None
    assert not is_vision_checkpoint(path)
    digest = hashlib.blake2b(digest_size=6)  # config and weights: no processor files
    digest.update((path / "config.json").read_bytes())
    digest.update(f"{WEIGHTS}:{xxh3_128_hexdigest((path / WEIGHTS).read_bytes())}".encode())
    assert loaded.revision == f"text@{digest.hexdigest()}"
