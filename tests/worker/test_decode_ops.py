"""The decode step's rewritten small ops against transformers: RoPE as a roll with a signed-sin
table gives its bits exactly; RMSNorm gives them on a GPU and in bf16, and on a CPU in float32
sums its squares as a tree of adds (worker/rms_norm.py), within a few ulps of them, the same
bits for a row whatever rows are beside it (docs/worker.md, The decode step)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.config import RopeScaling
from worker.model import RMSNorm
from worker.rms_norm import rms_norm, sum_of_squares
from worker.rope import RotaryEmbedding, rotate

llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def _pair(dtype: torch.dtype, rows: int) -> tuple[RMSNorm, torch.nn.Module, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    ours, theirs = RMSNorm(576, 1e-5), llama.LlamaRMSNorm(576, eps=1e-5)
    weight = 1 + 0.1 * torch.randn(576, generator=generator)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = (3 * torch.randn(rows, 576, generator=generator)).to(dtype)
    return ours.to(dtype), theirs.to(dtype), x


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rmsnorm_in_bf16_is_transformers_bit_for_bit(rows: int) -> None:
    ours, theirs, x = _pair(torch.bfloat16, rows)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rmsnorm_in_float32_on_a_cpu_is_within_a_few_ulps_of_transformers(rows: int) -> None:
    """The tree's sum of squares rounds differently from torch's running one in some rows (so
    the test would fail on equality): an ulp of the mean, through rsqrt and two products, is at
    most 4 float32 epsilons of an output relative to it."""
    ours, theirs, x = _pair(torch.float32, rows)
    with torch.no_grad():
        got, want = ours(x), theirs(x)
    ulps = ((got - want).abs() / torch.finfo(torch.float32).eps / want.abs()).max()
    assert float(ulps) <= 4.0, ulps


@given(
    width=st.integers(1, 700),
    rows=st.integers(2, 9),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_the_tree_sums_every_square_once_and_a_row_alone_gives_its_bits_in_a_batch(
    width: int, rows: int, scale: float, seed: int
) -> None:
    """Any width (odd ones set elements aside): the sum is the float64 sum's to float32's
    rounding over a tree, and a row's norm does not depend on the rows beside it."""
    x = scale * torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    exact = x.double().pow(2).sum(-1, keepdim=True)
    assert torch.allclose(sum_of_squares(x).double(), exact, rtol=width * 2e-7, atol=0)
    weight = torch.rand(width, generator=torch.Generator().manual_seed(seed + 1))
    together = rms_norm(x, weight, 1e-5)
    for row in range(rows):
        alone = rms_norm(x[row : row + 1].clone(), weight, 1e-5)
        assert torch.equal(alone, together[row : row + 1])


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
