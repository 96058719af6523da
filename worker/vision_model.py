"""The vision side of Idefics3 / SmolVLM: a SigLIP encoder and the pixel-shuffle connector.

    frames [N, 3, S, S] -> conv patches (P = (S/p)^2) + position embeddings
        -> [ LayerNorm -> bidirectional attention -> + -> LayerNorm -> gelu-tanh MLP -> + ] x L
        -> LayerNorm -> pixel shuffle (scale r: r x r patches -> one token, P / r^2 tokens)
        -> linear (no bias) into the text model's width -> [N, P / r^2, text hidden]

Attention within a frame is full (every patch sees every patch), through torch's
scaled_dot_product_attention. Parameter names are transformers' (`vision_model.*`,
`connector.modality_projection.proj.weight`, each under the checkpoint's `model.`), so a
checkpoint's tensors load as they are.

Every frame our image processor makes is a whole tile (S x S pixels of image, no padding), so
transformers' `patch_attention_mask` is all ones: no patch is masked, and each patch's position
id is what transformers' fractional-coordinate bucketing gives a full grid, computed once here
the same way (0 .. P-1 in row-major order; the bucketing is kept so that a grid whose float
steps round differently still matches). Padded or partial frames are not supported.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from worker.vision_config import VisionConfig, VlmConfig


def full_tile_position_ids(patches_per_side: int) -> torch.Tensor:
    """Position ids of a whole tile's patches, as transformers' Idefics3VisionEmbeddings
    computes them for an all-ones patch_attention_mask."""
    n = patches_per_side
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    coords = torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(n))
    buckets = torch.bucketize(torch.clamp(coords, max=1.0 - 1e-6), boundaries, right=True)
    return (buckets[:, None] * n + buckets[None, :]).reshape(-1)


class VisionEmbeddings(nn.Module):
    """`vision_model.embeddings`: patches by a strided convolution, plus learned positions."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size
        )
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)
        ids = full_tile_position_ids(config.patches_per_side)
        self.register_buffer("position_ids", ids, persistent=False)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(frames).flatten(2).transpose(1, 2)  # [N, P, hidden]
        return patches + self.position_embedding(self.position_ids)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, _ = x.shape
        q, k, v = (
            proj(x).view(n, p, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = functional.scaled_dot_product_attention(q, k, v)  # no mask: bidirectional
        return self.out_proj(out.transpose(1, 2).reshape(n, p, -1))


class VisionMlp(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(functional.gelu(self.fc1(x), approximate="tanh"))


class VisionLayer(nn.Module):
    """`vision_model.encoder.layers.N`: pre-LayerNorm attention and MLP, each residual."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """`vision_model.encoder`."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))


class VisionTransformer(nn.Module):
    """`vision_model`: frames [N, 3, S, S] -> patch states [N, P, vision hidden]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if frames.dim() != 4 or tuple(frames.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(
                f"frames must be [N, {self.config.num_channels}, {size}, {size}], got "
                f"{tuple(frames.shape)}"
            )
        x = self.embeddings(frames)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """transformers' Idefics3Connector.pixel_shuffle: [N, P, D] -> [N, P / r^2, D * r^2], each
    output token the r x r block of patches it covers (the same reshapes, in the same order)."""
    n, seq, dim = x.shape
    side = int(seq**0.5)
    r = scale_factor
    x = x.view(n, side, side, dim)
    x = x.view(n, side, side // r, dim * r)
    x = x.permute(0, 2, 1, 3)
    x = x.reshape(n, side // r, side // r, dim * r * r)
    x = x.permute(0, 2, 1, 3)
    return x.reshape(n, seq // (r * r), dim * r * r)


class ModalityProjection(nn.Module):
    def __init__(self, config: VlmConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.connector_in, config.text.hidden_size, bias=False)


class Connector(nn.Module):
    """`connector`: pixel shuffle, then `modality_projection.proj` into the text width."""

    def __init__(self, config: VlmConfig) -> None:
        super().__init__()
        self.scale_factor = config.scale_factor
        self.modality_projection = ModalityProjection(config)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(states, self.scale_factor))


class VisionTower(nn.Module):
    """Encoder and connector: frames [N, 3, S, S] -> image token embeddings
    [N, image_seq_len, text hidden]. Loads the checkpoint's `model.vision_model.*` and
    `model.connector.*` with the `model.` prefix removed."""

    def __init__(self, config: VlmConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = VisionTransformer(config.vision)
        self.connector = Connector(config)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.connector(self.vision_model(frames))

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load `vision_model.*` / `connector.*` tensors strictly."""
        missing, unexpected = self.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the vision tower: missing {missing}, unexpected {unexpected}"
            )


def vision_expected_shapes(config: VlmConfig, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Every tensor of the vision tower, transformers-named under `prefix`, in a stable order."""
    v = config.vision
    h, inter, p = v.hidden_size, v.intermediate_size, v.patch_size
    emb = f"{prefix}vision_model.embeddings"
    shapes: dict[str, tuple[int, ...]] = {
        f"{emb}.patch_embedding.weight": (h, v.num_channels, p, p),
        f"{emb}.patch_embedding.bias": (h,),
        f"{emb}.position_embedding.weight": (v.num_patches, h),
    }
    for i in range(v.num_layers):
        layer = f"{prefix}vision_model.encoder.layers.{i}"
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{layer}.{norm}.weight"] = (h,)
            shapes[f"{layer}.{norm}.bias"] = (h,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{layer}.self_attn.{proj}.weight"] = (h, h)
            shapes[f"{layer}.self_attn.{proj}.bias"] = (h,)
        shapes[f"{layer}.mlp.fc1.weight"] = (inter, h)
        shapes[f"{layer}.mlp.fc1.bias"] = (inter,)
        shapes[f"{layer}.mlp.fc2.weight"] = (h, inter)
        shapes[f"{layer}.mlp.fc2.bias"] = (h,)
    shapes[f"{prefix}vision_model.post_layernorm.weight"] = (h,)
    shapes[f"{prefix}vision_model.post_layernorm.bias"] = (h,)
    shapes[f"{prefix}connector.modality_projection.proj.weight"] = (
        config.text.hidden_size,
        config.connector_in,
    )
    return shapes
