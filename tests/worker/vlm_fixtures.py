"""A tiny Idefics3 / SmolVLM checkpoint built with transformers, and noise images (test-only).

`build_tiny_vlm` writes a complete Hugging Face directory of the Idefics3 family, the way a real
SmolVLM download looks: config.json (model_type "idefics3", text_config a Llama, vision_config a
SigLIP), model.safetensors written by transformers' own `save_pretrained`, tokenizer.json with
the processor's special tokens (<image>, <fake_token_around_image>, <global-img>,
<row_R_col_C>, <end_of_utterance>), tokenizer_config.json and chat_template.jinja carrying
SmolVLM's chat template, preprocessor_config.json as Idefics3ImageProcessor saves it and
processor_config.json with `image_seq_len`. The weights are seeded random normals scaled by fan-in
(transformers' 0.02 init makes a model that repeats its input, which would hide bugs); the same
seed gives the same files. `smolvlm_256m_config` is SmolVLM-256M-Instruct's shape, for
benchmarks with random weights; building it writes ~1 GB, so no ordinary test does.

transformers is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from worker.tiny_model import SPECIAL_TOKENS, tiny_tokenizer_json

TEXT_VOCAB = 512
"""The trained BPE's size; the image tokens are added after it."""
IMAGE_SPECIAL_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)
"""As SmolVLM's tokenizer adds them (ids TEXT_VOCAB, TEXT_VOCAB + 1, ...)."""
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
"""SmolVLM-256M-Instruct's template: messages' content is a list of text / image parts."""
__all__ = ["build_tiny_vlm", "png_bytes", "smolvlm_256m_config"]


def vlm_tokenizer_json() -> str:
    """The tiny text tokenizer (worker.tiny_model) plus the processor's special tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as BackendTokenizer

    backend = BackendTokenizer.from_str(tiny_tokenizer_json(TEXT_VOCAB))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IMAGE_SPECIAL_TOKENS]
    )
    return str(backend.to_str(pretty=True))


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": "<end_of_utterance>",
        "unk_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[2],
        "additional_special_tokens": list(IMAGE_SPECIAL_TOKENS[:3]),
        "chat_template": SMOLVLM_CHAT_TEMPLATE,
        "model_max_length": 2048,
        "processor_class": "Idefics3Processor",
    }


def preprocessor_config(tile: int, longest_edge: int, do_image_splitting: bool) -> dict[str, Any]:
    """What Idefics3ImageProcessor.save_pretrained writes for SmolVLM (resample 1 = LANCZOS)."""
    return {
        "do_convert_rgb": True,
        "do_image_splitting": do_image_splitting,
        "do_normalize": True,
        "do_pad": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Idefics3ImageProcessor",
        "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": tile},
        "processor_class": "Idefics3Processor",
        "resample": 1,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": longest_edge},
    }


def _patch_size(tile: int, scale_factor: int, image_seq_len: int | None, patch: int) -> int:
    """The vision patch size that gives `image_seq_len` tokens per tile (or `patch` as given)."""
    if image_seq_len is None:
        return patch
    side = math.isqrt(image_seq_len) * scale_factor
    if side * side != image_seq_len * scale_factor**2 or tile % side:
        raise ValueError(
            f"image_seq_len {image_seq_len} needs a square patch grid that divides tile {tile} "
            f"with scale_factor {scale_factor}"
        )
    return tile // side


def tiny_vlm_config(
    *,
    tile: int = 32,
    patch: int = 8,
    scale_factor: int = 2,
    image_token_id: int = TEXT_VOCAB + 1,
    tie_word_embeddings: bool = False,
) -> Any:
    """An Idefics3Config: SigLIP 32 wide, 2 layers; a Llama 64 wide, 2 layers, GQA 4:2."""
    from transformers import Idefics3Config

    vocab = TEXT_VOCAB + len(IMAGE_SPECIAL_TOKENS)
    text = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,  # not the default: catches a config read that ignores it
        "max_position_embeddings": 2048,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "hidden_act": "silu",
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": tile,
        "patch_size": patch,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
    }
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=scale_factor,
        image_token_id=image_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )


def smolvlm_256m_config() -> Any:
    """SmolVLM-256M-Instruct's shape as an Idefics3Config (random weights only: for benchmarks).

    SigLIP 768 wide, 12 layers, 12 heads, patch 16 on 512-pixel tiles, pixel shuffle 4 -> 64
    tokens a tile; SmolLM2-135M: 576 wide, 30 layers, 9 heads / 3 KV heads, vocab 49280."""
    from transformers import Idefics3Config

    text = {
        "model_type": "llama",
        "vocab_size": 49280,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "hidden_act": "silu",
    }
    vision = {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 512,
        "patch_size": 16,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
    }
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=4,
        image_token_id=TEXT_VOCAB + 1,  # the tiny tokenizer's <image> (SmolVLM's own is 49190)
        tie_word_embeddings=False,
    )


def seeded_weights(model: torch.nn.Module, seed: int) -> None:
    """Replace every parameter with seeded normals: norms 1 +- 0.1, biases 0.1, matrices and
    convolutions 1/sqrt(fan_in), embeddings (tokens, positions) 1/sqrt(width)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            shape = tuple(param.shape)
            noise = torch.randn(shape, generator=generator, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif "embed_tokens" in name or "position_embedding" in name or name == "lm_head.weight":
                value = noise * shape[-1] ** -0.5
            else:
                value = noise * math.prod(shape[1:]) ** -0.5
            param.copy_(value.to(param.dtype))


def _write_processor_files(
    path: Path, tile: int, longest_edge: int, image_seq_len: int, do_image_splitting: bool
) -> None:
    files: dict[str, Any] = {
        "tokenizer_config.json": _tokenizer_config(),
        "preprocessor_config.json": preprocessor_config(tile, longest_edge, do_image_splitting),
        "processor_config.json": {
            "image_seq_len": image_seq_len,
            "processor_class": "Idefics3Processor",
        },
    }
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    (path / "tokenizer.json").write_text(vlm_tokenizer_json())
    (path / "chat_template.jinja").write_text(SMOLVLM_CHAT_TEMPLATE)


def save_vlm(
    path: Path,
    config: Any,
    *,
    seed: int = 0,
    longest_edge: int,
    do_image_splitting: bool = True,
) -> Path:
    """Build `config` (an Idefics3Config) with seeded weights and write it as a full directory."""
    from transformers import Idefics3ForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    seeded_weights(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    vision = config.vision_config
    image_seq_len = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    _write_processor_files(path, vision.image_size, longest_edge, image_seq_len, do_image_splitting)
    return path


def build_tiny_vlm(
    path: Path,
    seed: int = 0,
    *,
    tile: int = 32,
    longest_edge: int = 64,
    image_seq_len: int | None = None,
    patch: int = 8,
    scale_factor: int = 2,
    do_image_splitting: bool = True,
    tie_word_embeddings: bool = False,
) -> Path:
    """A complete tiny Idefics3 directory at `path` (created if needed); returns `path`.

    `image_seq_len` (tokens per tile) defaults to (tile / patch)^2 / scale_factor^2 = 4; giving
    it picks the patch size instead. Every image is first resized so that its longest side is
    `longest_edge` (small ones are scaled up), then cut into tile x tile frames plus the global
    image: with 64 / 32, 2 x 2 + 1 frames for a squarish image, 1 x 2 + 1 for a wide one. With
    `longest_edge == tile` (or no splitting) every image is one frame."""
    patch = _patch_size(tile, scale_factor, image_seq_len, patch)
    config = tiny_vlm_config(
        tile=tile,
        patch=patch,
        scale_factor=scale_factor,
        tie_word_embeddings=tie_word_embeddings,
    )
    return save_vlm(
        path, config, seed=seed, longest_edge=longest_edge, do_image_splitting=do_image_splitting
    )


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """A random-noise RGB PNG of this size; distinct seeds give distinct files."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy(), "RGB").save(out, format="PNG")
    return out.getvalue()
