"""The configuration of an Idefics3 / SmolVLM checkpoint, read from its Hugging Face config.json.

An Idefics3 config.json (`model_type: "idefics3"`) nests two models and the glue between them:

    text_config    a Llama (SmolVLM's is SmolLM2): our `ModelConfig`, the text path as it is
    vision_config  a SigLIP encoder: `VisionConfig`
    scale_factor   the connector's pixel shuffle: scale^2 neighbouring patches become one token
    image_token_id the id of `<image>`, whose rows take the connector's outputs

so a tile of `image_size` pixels gives (image_size / patch_size)^2 / scale_factor^2 image tokens.
The text config is read as transformers writes it in either of its spellings (`rope_theta` and
`rope_scaling` of older files, `rope_parameters` of transformers 5). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.config import ModelConfig

MODEL_TYPE = "idefics3"
HIDDEN_ACTS = ("gelu_pytorch_tanh",)
"""The vision MLP activations the encoder implements (SigLIP's)."""


def is_vision_config(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json dict is an Idefics3 / SmolVLM vision-language model."""
    return raw.get("model_type") == MODEL_TYPE


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """The SigLIP vision encoder (transformers' Idefics3VisionConfig)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    """A tile's side in pixels: the encoder's square input."""
    patch_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "patch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"vision_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision_config.hidden_size ({self.hidden_size}) is not a multiple of "
                f"num_attention_heads ({self.num_heads})"
            )
        if self.image_size < self.patch_size or self.image_size % self.patch_size:
            raise ValueError(
                f"vision_config.image_size ({self.image_size}) is not a multiple of patch_size "
                f"({self.patch_size})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} not in {HIDDEN_ACTS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> VisionConfig:
        return cls(
            hidden_size=int(raw.get("hidden_size", 1152)),
            intermediate_size=int(raw.get("intermediate_size", 3072)),
            num_layers=int(raw.get("num_hidden_layers", 12)),
            num_heads=int(raw.get("num_attention_heads", 16)),
            image_size=int(raw.get("image_size", 224)),
            patch_size=int(raw.get("patch_size", 32)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-6)),
            num_channels=int(raw.get("num_channels", 3)),
            hidden_act=str(raw.get("hidden_act", "gelu_pytorch_tanh")),
        )


@dataclass(frozen=True, slots=True)
class VlmConfig:
    """An Idefics3 checkpoint: text model, vision encoder, connector."""

    text: ModelConfig
    vision: VisionConfig
    scale_factor: int
    image_token_id: int

    def __post_init__(self) -> None:
        side = self.vision.patches_per_side
        if self.scale_factor < 1 or side % self.scale_factor:
            raise ValueError(
                f"scale_factor {self.scale_factor} does not divide the {side} patches a side of "
                f"a {self.vision.image_size}-pixel tile"
            )
        if not 0 <= self.image_token_id < self.text.vocab_size:
            raise ValueError(
                f"image_token_id {self.image_token_id} is outside the text vocabulary "
                f"({self.text.vocab_size})"
            )

    @property
    def image_seq_len(self) -> int:
        """Image tokens (connector outputs) per tile."""
        return self.vision.num_patches // self.scale_factor**2

    @property
    def connector_in(self) -> int:
        """Width of one pixel-shuffled token: scale^2 patches side by side."""
        return self.vision.hidden_size * self.scale_factor**2

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> VlmConfig:
        """From an Idefics3 config.json dict. The LM head is tied as the top-level
        `tie_word_embeddings` says (transformers ties by it; its default is False)."""
        if not is_vision_config(raw):
            raise ValueError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE!r}")
        text = dict(text_config_dict(raw.get("text_config") or {}))
        text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
        text.setdefault("model_type", "llama")
        for key in ("torch_dtype", "dtype"):  # the checkpoint's dtype is stated at the top
            if key in raw and key not in text:
                text[key] = raw[key]
        return cls(
            text=ModelConfig.from_hf(text),
            vision=VisionConfig.from_hf(raw.get("vision_config") or {}),
            scale_factor=int(raw.get("scale_factor", 2)),
            image_token_id=int(raw["image_token_id"]),
        )


def text_config_dict(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`text_config` with transformers 5's `rope_parameters` spelt as `rope_theta` and
    `rope_scaling`, the keys `ModelConfig.from_hf` reads."""
    text = dict(raw)
    rope = text.get("rope_parameters")
    if isinstance(rope, Mapping):
        if "rope_theta" in rope:
            text.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default" and not text.get("rope_scaling"):
            text["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return text
