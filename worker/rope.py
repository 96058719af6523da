"""Rotary position embeddings with the scaling variants of the Llama / Qwen family.

`inv_frequencies` gives the per-pair frequencies for a `RopeScaling`; `RotaryEmbedding` keeps a
cos/sin table over positions and applies the rotation in Hugging Face's half-split layout
(pairs are (i, i + head_dim / 2)), computed in float32 exactly as Hugging Face does (the
models were trained with those rotations). Dynamic NTK scaling evaluates Hugging Face's formula
once, at the configured max_position_embeddings, instead of growing the base with each sequence:
a position's rotation must not depend on how long its sequence became later, or cached KV would
disagree with recomputed KV. Within the original context (max_positions == original) nothing is
scaled, exactly as Hugging Face does there.
"""

from __future__ import annotations

import math

import torch

from worker.config import RopeScaling


def inv_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling, max_positions: int
) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    original = scaling.original_max_position_embeddings
    if scaling.kind == "dynamic" and max_positions > original:
        growth = scaling.factor * max_positions / original - (scaling.factor - 1)
        theta = theta * growth ** (head_dim / (head_dim - 2))
    inv = 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv, scaling)
    return inv


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    cos: torch.Tensor
    signed_sin: torch.Tensor

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling, max_positions: int
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv = inv_frequencies(head_dim, theta, scaling, max_positions)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("signed_sin", torch.empty(0), persistent=False)
        self._extend(max_positions)

    def _extend(self, positions: int) -> None:
        angles = torch.outer(torch.arange(positions, dtype=torch.float32), self.inv)
        device = self.cos.device
        self.cos = torch.cat([angles, angles], dim=-1).cos().to(device)
        sin = angles.sin()
        self.signed_sin = torch.cat([-sin, sin], dim=-1).to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, D] of the tokens' positions (see `rotate`): once per step,
        shared by every layer."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        if needed > self.cos.shape[0]:
            self._extend(max(needed, 2 * self.cos.shape[0]))
        return self.cos[positions][:, None, :], self.signed_sin[positions][:, None, :]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by their tokens' positions [T]."""
        cos, signed_sin = self.lookup(positions)
        return rotate(q, cos, signed_sin), rotate(k, cos, signed_sin)


def rotate_promoted(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotate` of a bf16 kernel output in float32 by promotion (its values upcast exactly, as
    `.float()` would), without the casts: the flat decode loop's and its compiled graph's."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's x * cos + rotate_half(x) * sin, in float32, back in x's dtype.

    rotate_half(x) = cat(-x2, x1) is roll(x, D/2) with its first half negated, so with the sign
    kept in the table (signed_sin = cat(-sin1, sin2)) it is one roll: the same products, bit for
    bit, in four ops instead of nine (a decode step runs this 60 times)."""
    return rotate_promoted(x.float(), cos, signed_sin).to(x.dtype)
