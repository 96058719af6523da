"""Read an Idefics3 / SmolVLM checkpoint directory: config, text weights, vision weights. Offline.

The directory is what transformers' `save_pretrained` writes (and what the Hub holds for
SmolVLM): config.json with `model_type: "idefics3"`, safetensors (one file or an index), the
tokenizer files, preprocessor_config.json and processor_config.json. Its tensors are

    model.text_model.*              the Llama text model  -> `model.*` for worker.model.CausalLM
    lm_head.weight                  absent when the config ties it to the embedding
    model.vision_model.*            SigLIP encoder        -> `vision_model.*` for VisionTower
    model.connector.modality_projection.proj.weight       -> `connector.*`

Every tensor is checked by name and shape against what the config implies before anything is
built: a missing, unexpected or misshapen tensor is a `CheckpointError` that names it, under its
name in the checkpoint. The processor's settings must agree with the model (tile = the encoder's
image size, image_seq_len = the connector's output per tile, the same image token), or the
prompt's image runs would not fit the embeddings: that is a CheckpointError too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from worker.checkpoint import (
    CheckpointError,
    check_dtype,
    check_shapes,
    dtype_name,
    expected_shapes,
    read_raw_config,
    read_tensors,
)
from worker.image_processor import ImageProcessorConfig
from worker.image_prompt import ImagePromptSpec
from worker.vision_config import VlmConfig, is_vision_config
from worker.vision_model import vision_expected_shapes

TEXT_PREFIX = "model.text_model."
VISION_PREFIX = "model."
"""`model.vision_model.*` and `model.connector.*` lose it for VisionTower."""


@dataclass(frozen=True)
class VlmCheckpoint:
    config: VlmConfig
    text_state: dict[str, torch.Tensor]
    """Named for worker.model.CausalLM (`model.*`, `lm_head.weight`)."""
    vision_state: dict[str, torch.Tensor]
    """Named for worker.vision_model.VisionTower (`vision_model.*`, `connector.*`)."""
    spec: ImagePromptSpec
    processor: ImageProcessorConfig


def is_vision_checkpoint(path: Path) -> bool:
    """Whether the directory's config.json is an Idefics3 model (False without one)."""
    return (Path(path) / "config.json").is_file() and is_vision_config(read_raw_config(path))


def _text_name(name: str) -> str:
    """A CausalLM name in the checkpoint: `model.x` -> `model.text_model.x`."""
    return TEXT_PREFIX + name.removeprefix("model.") if name.startswith("model.") else name


def vlm_expected_shapes(config: VlmConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of an Idefics3 checkpoint of `config`, as the checkpoint names it."""
    shapes = {_text_name(name): shape for name, shape in expected_shapes(config.text).items()}
    shapes.update(vision_expected_shapes(config, VISION_PREFIX))
    return shapes


def read_vlm_config(path: Path) -> VlmConfig:
    try:
        return VlmConfig.from_hf(read_raw_config(path))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"{Path(path) / 'config.json'} is not a usable Idefics3 config: {error!r}"
        ) from error


def read_processor(path: Path, config: VlmConfig) -> tuple[ImagePromptSpec, ImageProcessorConfig]:
    """The prompt spec and the image processor's settings, checked against the model."""
    path = Path(path)
    try:
        processor = ImageProcessorConfig.from_dir(path)
        spec = ImagePromptSpec.from_dir(path, read_raw_config(path))
    except (FileNotFoundError, KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: unusable image processor settings: {error}") from error
    wrong = [
        f"{what} is {got}, the model's is {want}"
        for what, got, want in (
            ("max_image_size.longest_edge (tile)", spec.tile_size, config.vision.image_size),
            ("image_seq_len", spec.image_seq_len, config.image_seq_len),
            ("the image token", spec.image_token_id, config.image_token_id),
        )
        if got != want
    ]
    if wrong:
        raise CheckpointError(f"{path}: the processor does not fit the model: " + "; ".join(wrong))
    return spec, processor


def load_vlm_checkpoint(path: Path, dtype: torch.dtype | None = None) -> VlmCheckpoint:
    """Read and check an Idefics3 directory; `dtype` casts every tensor (else each keeps its
    stored dtype, and the text config's `dtype` is theirs when they share one)."""
    check_dtype(dtype)
    path = Path(path)
    config = read_vlm_config(path)
    spec, processor = read_processor(path, config)
    state = read_tensors(path, dtype)
    if config.text.tie_word_embeddings and "lm_head.weight" in state:
        del state["lm_head.weight"]  # a tied head stored anyway: the embedding is the head
    check_shapes(vlm_expected_shapes(config), state, source=str(path))
    text_state: dict[str, torch.Tensor] = {}
    vision_state: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(TEXT_PREFIX):
            text_state["model." + name.removeprefix(TEXT_PREFIX)] = tensor
        elif name == "lm_head.weight":
            text_state[name] = tensor
        else:
            vision_state[name.removeprefix(VISION_PREFIX)] = tensor
    dtypes = {tensor.dtype for tensor in state.values()}
    if len(dtypes) == 1:
        config = replace(config, text=replace(config.text, dtype=dtype_name(dtypes.pop())))
    return VlmCheckpoint(config, text_state, vision_state, spec, processor)
