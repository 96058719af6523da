"""Plain-torch paged KV write and attention: the CPU serving path and the oracle of every test.

Gather a sequence's K/V through its page-table row, build the mask as a dense boolean matrix, run
a softmax. Written to be obviously right, not fast: no tiling, no online softmax. Half-precision
inputs are computed in float32, float32 and float64 in their own dtype (tests pass float64 copies
to get an exact oracle). Never reads a slot beyond a sequence's length, never writes anything but
`out` and, for `write_kv`, the slots it was given.
"""

from __future__ import annotations

import torch

from kernels.layout import cdiv, softmax_scale_or_default


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache.view(-1, kv_heads, head_dim)[slot_mapping[t]] = k[t] (same for v); slot < 0 skips."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V as contiguous [seq_len, kv_heads, head_dim] tensors."""
    page_size = k_cache.shape[1]
    pages = page_table_row[: cdiv(seq_len, page_size)].to(torch.int64)
    k = k_cache[pages].flatten(0, 1)[:seq_len]
    v = v_cache[pages].flatten(0, 1)[:seq_len]
    return k, v


def gather_kv_padded(
    k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, longest: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's K and V up to `longest` positions, [batch, longest, kv_heads, head_dim]
    (batch = page_table rows). Positions past a sequence's own length hold whatever their slots
    (or, past its pages, page ids clamped into range) hold: the caller masks them."""
    pages = page_table[:, : cdiv(longest, k_cache.shape[1])].to(torch.int64)
    pages = pages.clamp(0, k_cache.shape[0] - 1)
    k = k_cache[pages].flatten(1, 2)[:, :longest]
    v = v_cache[pages].flatten(1, 2)[:, :longest]
    return k, v


def prefix_lm_mask(
    seq_len_q: int, seq_len_k: int, regions: list[tuple[int, int]], device: torch.device
) -> torch.Tensor:
    """[seq_len_q, seq_len_k] bool: may query i (KV position seq_len_k - seq_len_q + i) see key j.

    Causal, right-aligned: j <= seq_len_k - seq_len_q + i. Plus, for each (start, end) region,
    every position inside it sees every other position inside it (bidirectional image tokens).
    """
    rows = torch.arange(seq_len_q, device=device)[:, None] + (seq_len_k - seq_len_q)
    cols = torch.arange(seq_len_k, device=device)[None, :]
    mask = cols <= rows
    for start, end in regions:
        mask |= (rows >= start) & (rows < end) & (cols >= start) & (cols < end)
    return mask


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [Lq, Hq, D], k/v [Lk, Hk, D], mask [Lq, Lk].

    Query head h reads KV head h // (Hq // Hk) (GQA). Every row of the mask must allow a key.
    """
    dtype = _compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k) * softmax_scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _regions_by_sequence(
    image_regions: torch.Tensor | None, batch: int
) -> list[list[tuple[int, int]]]:
    by_seq: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
    if image_regions is not None:
        for seq, start, end in image_regions.tolist():
            by_seq[seq].append((start, end))
    return by_seq


def append_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    softmax_scale: float | None = None,
    image_regions: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query chunk q[cu[i]:cu[i+1]] attends to its sequence's first seq_lens_k[i] KV slots."""
    del max_seqlen_q  # a launch-size hint for GPU backends
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens_q.tolist()
    lens_k = seq_lens_k.tolist()
    regions = _regions_by_sequence(image_regions, len(lens_k))
    for i, seq_len_k in enumerate(lens_k):
        q_i = q[cu[i] : cu[i + 1]]
        k, v = gather_kv(k_cache, v_cache, page_table[i], seq_len_k)
        mask = prefix_lm_mask(q_i.shape[0], seq_len_k, regions[i], q.device)
        out[cu[i] : cu[i + 1]] = masked_attention(q_i, k, v, mask, scale).to(out.dtype)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, q_heads, head_dim]: one query per sequence over its first seq_lens[b] slots.

    Batched: every sequence's pages are gathered up to the longest one and a length mask hides the
    rest (entries past a sequence's pages may be anything; they are clamped, then masked).
    """
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    out = torch.empty_like(q) if out is None else out
    longest = int(seq_lens.max())
    k, v = gather_kv_padded(k_cache, v_cache, page_table[: q.shape[0]], longest)
    valid = torch.arange(longest, device=q.device)[None, :] < seq_lens[:, None]
    dtype = _compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[2]
    k = k.to(dtype).repeat_interleave(group, dim=2)
    v = v.to(dtype).masked_fill(~valid[:, :, None, None], 0.0).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bkhd->bhk", q.to(dtype), k) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out.copy_(torch.einsum("bhk,bkhd->bhd", torch.softmax(scores, dim=-1), v))
    return out
