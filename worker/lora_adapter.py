"""A LoRA adapter as the worker holds it: per (layer, module) the two low-rank factors.

    W' = W + scaling * B @ A        A: [rank, in]   B: [out, rank]   scaling = alpha / rank

`load_adapter` reads a PEFT directory (adapter_config.json + adapter_model.safetensors) and
checks it against the base model; this module only defines what it returns. The adapter's
identity, `name@digest`, is its part of the cache namespace: the digest covers its weights and
scaling, so reloading other weights under the same name never meets the old KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (Llama names: self_attn.* and mlp.*)."""


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and, where one is at
    fault, the tensor."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    """What multiplies B @ A (alpha / rank; alpha / sqrt(rank) for rsLoRA)."""
    digest: str
    """16 hex digits of a blake2b digest of the scaling and every tensor (name, shape, bytes)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, module) -> (A [rank, in], B [out, rank]), float32 on the CPU."""

    @property
    def identity(self) -> str:
        """The adapter's part of the cache namespace (and of the router's block hashes)."""
        return f"{self.name}@{self.digest}"

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {module for _, module in self.weights}
        return tuple(m for m in TARGET_MODULES if m in present)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())
