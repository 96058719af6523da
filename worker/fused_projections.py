"""`FusedProjections`: the projections that read one input (q/k/v; gate/up) multiplied as one.

A decode step multiplies one row by each of a layer's seven matrices; every call pays the
dispatch, the cast of the row to bf16 and back, and the kernel's own start-up, which for
matrices this small is a large part of the call. Side by side, q/k/v are one [q + 2 kv, hidden]
matrix and gate/up one [2 intermediate, hidden] (vLLM's QKVParallelLinear and
MergedColumnParallelLinear), so a layer makes four calls instead of seven, and prefill
dequantizes and multiplies two matrices instead of five.

`QuantizedLinear.concat` holds the weights once: the parts (still `q_proj`, ... on the model,
so names, tests and LoRA see what they saw) become views of the fused buffers. Each output
column is the same dot product either way, so the fused outputs equal the parts' bit for bit
(tested). `forward` returns the fused output [tokens, rows]; `split` cuts it into the parts'
outputs, as views (a part padded to a whole int4 block loses its padding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.quantized_linear import QuantizedLinear

if TYPE_CHECKING:
    from worker.model import CausalLM


class FusedProjections(nn.Module):
    def __init__(self, parts: Sequence[QuantizedLinear]) -> None:
        super().__init__()
        self.linear = QuantizedLinear.concat(parts)
        self.sizes = tuple(p.out_features for p in parts)
        self.starts = tuple(sum(p.rows for p in parts[:i]) for i in range(len(parts)))
        self.adjacent = all(p.rows == p.out_features for p in parts[:-1])
        """Each part's outputs start where the previous part's end (no padding between), so
        neighbouring parts can be read as one tensor (q and k, rotated together)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in] -> [tokens, rows]: every part's outputs side by side."""
        out: torch.Tensor = self.linear(x)
        return out

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts' outputs [tokens, out_i], views of `y`."""
        return tuple(
            y[:, start : start + size] for start, size in zip(self.starts, self.sizes, strict=True)
        )


def fuse_projections(model: CausalLM) -> int:
    """Give each decoder layer of `model` whose q/k/v (and gate/up) are QuantizedLinears of one
    kind a `qkv_proj` (`gate_up_proj`) fusing them; returns how many groups were fused. Parts
    of different kinds (a GGUF file mixing Q8_0 and Q4 in one layer) stay apart."""
    fused = 0
    for layer in model.model.layers:
        groups = (
            (layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
            (layer.mlp, "gate_up_proj", ("gate_proj", "up_proj")),
        )
        for parent, name, attrs in groups:
            parts = [getattr(parent, attr) for attr in attrs]
            if (
                all(isinstance(p, QuantizedLinear) for p in parts)
                and len({p.kind for p in parts}) == 1
            ):
                setattr(parent, name, FusedProjections(parts))
                fused += 1
    model.forget_decode_layers()  # worker/decode_layers.py reads these modules
    return fused
