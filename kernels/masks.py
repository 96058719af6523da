"""Image regions as per-query horizons: the last key each query token may see (prefix-LM mask).

`image_regions` is an int32 tensor [num_regions, 3] of rows (seq, start, end): KV positions
start .. end-1 of sequence `seq` (its index in the batch) are one image, attended bidirectionally.
A query at KV position p sees key j when j <= horizon(p), where

    horizon(p) = end - 1   if start <= p < end for one of its sequence's regions
                 p         otherwise (plain causal)

This equals the mask "causal, or both inside one region", because every key before p is visible
anyway. Computed with a few device ops and no synchronisation. Never launches a Triton kernel.
"""

from __future__ import annotations

import torch


def query_horizons(
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    image_regions: torch.Tensor,
    total_q: int,
) -> torch.Tensor:
    """int32 [total_q]: the last KV position each query token may attend to."""
    device = cu_seqlens_q.device
    starts = cu_seqlens_q[:-1].to(torch.int64)
    q_lens = cu_seqlens_q[1:].to(torch.int64) - starts
    seq_of_token = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=device), q_lens, output_size=total_q
    )
    offsets = seq_lens_k.to(torch.int64) - q_lens
    pos = torch.arange(total_q, device=device) - starts[seq_of_token] + offsets[seq_of_token]
    if image_regions.shape[0] == 0:
        return pos.to(torch.int32)
    r_seq, r_start, r_end = (c.to(torch.int64) for c in image_regions.unbind(1))
    inside = (
        (seq_of_token[:, None] == r_seq[None, :])
        & (pos[:, None] >= r_start[None, :])
        & (pos[:, None] < r_end[None, :])
    )
    region_last = torch.where(inside, r_end[None, :] - 1, -1).amax(dim=1)
    return torch.maximum(pos, region_last).to(torch.int32)
