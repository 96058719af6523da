"""Random paged batches for kernel tests, and the error check every comparison uses.

A batch is built the way serving leaves memory: pages handed out in shuffled order with unused
pages between them, every slot nobody wrote (page 0, the tail of each last page, spare pages)
holding NaN, and page-table entries past a sequence's pages pointing at the NaN page 0. A kernel
that reads one slot too many therefore returns NaN, which `assert_close` reports.

Every test draws a fresh seed (or takes KERNEL_TEST_SEED to replay one) and puts it in its
failure messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.layout import cdiv

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
"""Largest allowed ||actual - oracle|| / ||oracle||, the oracle evaluated in float64."""


def fresh_seed() -> int:
    env = os.environ.get("KERNEL_TEST_SEED")
    return int(env) if env else int.from_bytes(os.urandom(4), "little")


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(
    gen: torch.Generator, *shape: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Standard normal values, never exactly zero, drawn on the CPU (reproducible) then moved."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
    return x.to(dtype=dtype, device=device)


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [num_pages, page_size, kv_heads, head_dim], unwritten slots NaN
    v_cache: torch.Tensor
    page_table: torch.Tensor  # int32 [batch + spare rows, max_pages]
    seq_lens_k: torch.Tensor  # int32 [batch]
    cu_seqlens_q: torch.Tensor  # int32 [batch + 1]
    q: torch.Tensor  # [total_q, q_heads, head_dim]

    @property
    def q_lens(self) -> list[int]:
        return (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).tolist()

    def as_float64(self) -> PagedBatch:
        return PagedBatch(
            self.k_cache.double().cpu(),
            self.v_cache.double().cpu(),
            self.page_table.cpu(),
            self.seq_lens_k.cpu(),
            self.cu_seqlens_q.cpu(),
            self.q.double().cpu(),
        )


def make_batch(
    seed: int,
    q_lens: list[int],
    k_lens: list[int],
    *,
    page_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> PagedBatch:
    """A batch: sequence i has k_lens[i] written KV positions and a query chunk of q_lens[i]."""
    assert len(q_lens) == len(k_lens), f"{len(q_lens)} query lengths for {len(k_lens)} sequences"
    assert all(1 <= q <= k for q, k in zip(q_lens, k_lens, strict=True)), f"{q_lens} vs {k_lens}"
    gen = generator(seed)
    pages_per_seq = [cdiv(k, page_size) for k in k_lens]
    spare = 3 + sum(pages_per_seq) // 2
    num_pages = 1 + sum(pages_per_seq) + spare
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 stays unused
    max_pages = max(pages_per_seq) + 2
    page_table = torch.zeros(len(k_lens) + 2, max_pages, dtype=torch.int32)
    page_table[len(k_lens) :] = torch.randint(0, 1 << 30, (2, max_pages), generator=gen)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    for i, (n_pages, k_len) in enumerate(zip(pages_per_seq, k_lens, strict=True)):
        pages = [order.pop() for _ in range(n_pages)]
        page_table[i, :n_pages] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)[None, :]
        slots = slots.flatten()[:k_len]
        k_cache.view(-1, kv_heads, head_dim)[slots] = randn(
            gen, k_len, kv_heads, head_dim, dtype=torch.float64, device=torch.device("cpu")
        )
        v_cache.view(-1, kv_heads, head_dim)[slots] = randn(
            gen, k_len, kv_heads, head_dim, dtype=torch.float64, device=torch.device("cpu")
        )
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(gen, int(cu[-1]), kv_heads * group, head_dim, dtype=dtype, device=device)
    return PagedBatch(
        k_cache.to(dtype=dtype, device=device),
        v_cache.to(dtype=dtype, device=device),
        page_table.to(device),
        torch.tensor(k_lens, dtype=torch.int32, device=device),
        cu.to(device),
        q,
    )


def relative_error(actual: torch.Tensor, oracle: torch.Tensor) -> float:
    diff = actual.double().cpu() - oracle.double().cpu()
    return float(diff.norm() / oracle.double().cpu().norm())


MAX_ERRORS: dict[tuple[str, str], float] = {}
"""Largest relative error seen this session per (kernel, dtype); printed in the terminal summary."""


def assert_close(
    actual: torch.Tensor, oracle: torch.Tensor, seed: int, kernel: str, detail: str = ""
) -> float:
    """Every element written and finite, relative error norm within TOLERANCE; returns the error."""
    what = f"{kernel} {detail}".strip()
    replay = f"(seed {seed}; replay with KERNEL_TEST_SEED={seed})"
    assert actual.shape == oracle.shape, (
        f"{what}: shape {list(actual.shape)} != {list(oracle.shape)} {replay}"
    )
    unwritten = int((~torch.isfinite(actual)).sum())
    assert unwritten == 0, (
        f"{what}: {unwritten} of {actual.numel()} outputs are NaN/inf "
        f"(never written, or a poisoned slot was read) {replay}"
    )
    error = relative_error(actual, oracle)
    key = (kernel, str(actual.dtype).removeprefix("torch."))
    MAX_ERRORS[key] = max(MAX_ERRORS.get(key, 0.0), error)
    tolerance = TOLERANCE[actual.dtype]
    assert error <= tolerance, f"{what}: relative error {error:.3e} > {tolerance:.0e} {replay}"
    return error


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))
