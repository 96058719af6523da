"""The decode step's rewritten small ops give transformers' bits exactly: RMSNorm through torch's
fused rms_norm, RoPE as a roll with a signed-sin table (docs/worker.md, The decode step)."""

from __future__ import annotations

import pytest
import torch

from worker.config import RopeScaling
from worker.model import RMSNorm
from worker.rope import RotaryEmbedding, rotate

llama = pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rmsnorm_is_transformers_bit_for_bit(dtype: torch.dtype, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    ours, theirs = RMSNorm(576, 1e-5), llama.LlamaRMSNorm(576, eps=1e-5)
    weight = 1 + 0.1 * torch.randn(576, generator=generator)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = (3 * torch.randn(rows, 576, generator=generator)).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(64, 10000.0, RopeScaling(), 256)
    positions = torch.tensor([0, 1, 5, 77, 255, 300])  # 300: past the table, which grows
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(6, 9, 64, generator=generator).to(dtype)
    k = torch.randn(6, 3, 64, generator=generator).to(dtype)
    cos, signed_sin = rotary.lookup(positions)
    half = signed_sin.shape[-1] // 2
    sin = torch.cat([-signed_sin[..., :half], signed_sin[..., half:]], -1)  # the plain sin
    angles = positions[:, None].float() * rotary.inv[None, :]
    assert torch.equal(sin[:, 0], torch.cat([angles, angles], -1).sin())
    # transformers' formula on [tokens, heads, d] with cos / sin [tokens, d], in float32
    want_q, want_k = llama.apply_rotary_pos_emb(
        q.float(), k.float(), cos[:, 0], sin[:, 0], unsqueeze_dim=1
    )
    assert torch.equal(rotate(q, cos, signed_sin), want_q.to(dtype))
    assert torch.equal(rotate(k, cos, signed_sin), want_k.to(dtype))
    assert torch.equal(q.float() * cos + llama.rotate_half(q.float()) * sin, want_q)
