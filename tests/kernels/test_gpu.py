"""CUDA only: dispatch routes to compiled kernels, and Llama-8B-shaped calls match the float64
reference (run on the GPU). flash-attn, where installed, is held to the same oracle."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import append_prefill_attention, choose_backend, decode_attention, flash
from tests.kernels.helpers import PagedBatch, assert_close, fresh_seed, make_batch, poisoned_like

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def llama_batch(seed: int, q_lens: list[int], k_lens: list[int], page_size: int) -> PagedBatch:
    return make_batch(
        seed, q_lens, k_lens, page_size=page_size, kv_heads=8, group=4, head_dim=128,
        dtype=torch.bfloat16, device=CUDA,
    )  # fmt: skip


def prefill_oracle(batch: PagedBatch) -> torch.Tensor:
    from kernels import reference

    return reference.append_prefill_attention(
        batch.q.double(), batch.k_cache.double(), batch.v_cache.double(), batch.page_table,
        batch.cu_seqlens_q, batch.seq_lens_k,
    )  # fmt: skip


def decode_oracle(batch: PagedBatch) -> torch.Tensor:
    from kernels import reference

    return reference.decode_attention(
        batch.q.double(), batch.k_cache.double(), batch.v_cache.double(), batch.page_table,
        batch.seq_lens_k,
    )  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_cuda_routes_to_compiled_kernels(page_size: int) -> None:
    cache = torch.empty(4, page_size, 8, 128, dtype=torch.bfloat16, device=CUDA)
    assert choose_backend("write_kv", cache) == "triton"
    expected = (
        "flash" if flash.why_not(CUDA, cache.dtype, page_size, 128, False) is None else "triton"
    )
    assert choose_backend("append_prefill_attention", cache) == expected
    assert choose_backend("decode_attention", cache) == expected
    assert choose_backend("append_prefill_attention", cache, has_regions=True) == "triton"
    assert choose_backend("decode_attention", cache.double()) == "reference"


@pytest.mark.parametrize("page_size", [1, 16])
def test_llama_shaped_prefill_and_decode(page_size: int) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    k_lens = [rng.randint(1000, 3000), 700, rng.randint(2000, 5000), 1]
    q_lens = [rng.randint(16, 300), 700, 1, 1]
    batch = llama_batch(seed, q_lens, k_lens, page_size)
    out = poisoned_like(batch.q)
    append_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.cu_seqlens_q,
        batch.seq_lens_k, max_seqlen_q=max(q_lens), out=out,
    )  # fmt: skip
    assert_close(out, prefill_oracle(batch), seed, "gpu_prefill", f"page_size={page_size}")
    decode_q = batch.q[: len(k_lens)].contiguous()
    decoded = PagedBatch(**{**batch.__dict__, "q": decode_q})
    got = decode_attention(
        decode_q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens_k
    )
    assert_close(got, decode_oracle(decoded), seed, "gpu_decode", f"page_size={page_size}")


@pytest.mark.skipif(not flash.AVAILABLE, reason="flash-attn is not installed")
def test_flash_adapter_matches_the_reference() -> None:
    seed = fresh_seed()
    batch = llama_batch(seed, [40, 1, 300], [600, 257, 300], page_size=256)
    out = append_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.cu_seqlens_q,
        batch.seq_lens_k, backend="flash",
    )  # fmt: skip
    assert_close(out, prefill_oracle(batch), seed, "flash_prefill")
    decode_q = batch.q[:3].contiguous()
    got = decode_attention(
        decode_q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens_k, backend="flash"
    )
    expected = decode_oracle(PagedBatch(**{**batch.__dict__, "q": decode_q}))
    assert_close(got, expected, seed, "flash_decode")
