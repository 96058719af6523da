"""The CPU serving path: paged attention through torch's fused scaled_dot_product_attention.

Same contract as kernels/reference.py (the oracle it is tested against in float64), but each
sequence's attention is one fused SDPA call with native GQA (`enable_gqa`) instead of repeated
heads, einsums and a separate softmax: about 5x less time per decode layer on a CPU.

SDPA's own `is_causal` aligns the mask top-left; a chunk over a cached prefix needs it
bottom-right (query i sees keys 0 .. seq_len_k - seq_len_q + i), so only a chunk that is the
whole sequence uses `is_causal`; the others get the explicit mask the reference builds. Unwritten
slots may hold anything (NaN included): past a sequence's length both keys and values are zeroed
before the call (SDPA adds the mask to the scores, and NaN + -inf is NaN; 0 x NaN is NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from kernels.layout import cdiv, softmax_scale_or_default
from kernels.reference import _regions_by_sequence, gather_kv, prefix_lm_mask

__all__ = ["LoneDecode", "append_prefill_attention", "decode_attention", "write_kv"]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`index_copy_` into the flattened slots (a third of the reference's boolean-mask cost);
    tokens with a negative slot (padding) are dropped first, only when there are any."""
    slots, keep = _STEP_MEMO.lookup(("slots", slot_mapping), (), lambda: _slots(slot_mapping))
    if keep is not None:
        k, v = k[keep], v[keep]
    _copy_to_slots(k_cache, v_cache, k, v, slots)


def _copy_to_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: Any
) -> None:
    """k[t], v[t] into int64 slot slots[t] of the flattened caches, in the caches' dtype."""
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def _slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots as int64 without the padding's, and the mask of the tokens kept (None: all)."""
    slots = slot_mapping.to(torch.int64)
    padding = slots < 0
    if not bool(padding.any()):
        return slots, None
    keep = ~padding
    return slots[keep], keep


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
    del max_seqlen_q
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens_q.tolist()
    lens_k = seq_lens_k.tolist()
    regions = _regions_by_sequence(image_regions, len(lens_k))
    for i, seq_len_k in enumerate(lens_k):
        q_i = q[cu[i] : cu[i + 1]]
        k, v = gather_kv(k_cache, v_cache, page_table[i], seq_len_k)
        whole = q_i.shape[0] == seq_len_k and not regions[i]
        mask = None if whole else prefix_lm_mask(q_i.shape[0], seq_len_k, regions[i], q.device)
        attended = sdpa(
            q_i.transpose(0, 1)[None],
            k.to(q.dtype).transpose(0, 1)[None],
            v.to(q.dtype).transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=whole,
            scale=scale,
            enable_gqa=True,
        )
        out[cu[i] : cu[i + 1]] = attended[0].transpose(0, 1).to(out.dtype)
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
    """All sequences in one SDPA call over their pages gathered up to the longest one.

    The pages are gathered with one `index_select` of whole pages per cache (a contiguous copy),
    not advanced indexing: a third of the time on a decode step's few pages, same values. A
    lone sequence whose pages are consecutive ids (one decoding alone, its pages taken from
    the free stack in order) is read in place instead: the cache's own pages, sliced, are the
    tensor the gather would have copied, with the same shape and strides."""
    scale = softmax_scale_or_default(softmax_scale, q.shape[-1])
    batch, (num_pages, page_size) = q.shape[0], k_cache.shape[:2]
    pages, longest, masks, first = _STEP_MEMO.lookup(
        ("decode", page_table, seq_lens),
        (batch, num_pages, page_size),
        lambda: _decode_plan(page_table[:batch], seq_lens, num_pages, page_size),
    )
    if first is not None:
        end = first + pages.shape[0]
        k, v = (_window(cache, first, end, longest) for cache in (k_cache, v_cache))
    else:
        k = k_cache.index_select(0, pages).view(batch, -1, *k_cache.shape[2:])[:, :longest]
        v = v_cache.index_select(0, pages).view(batch, -1, *v_cache.shape[2:])[:, :longest]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    mask = None
    if masks is not None:
        padding, mask = masks
        k, v = k.masked_fill(padding, 0.0), v.masked_fill(padding, 0.0)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    attended = sdpa(q[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if out is None:
        return attended[:, :, 0, :]
    out.copy_(attended[:, :, 0, :])
    return out


@dataclass(frozen=True, slots=True)
class LoneDecode:
    """A decode step of one sequence whose pages are consecutive ids, planned once for every
    layer: `write` is `write_kv`'s `index_copy_` and `attend` `decode_attention`'s in-place
    read, the same ops on the same tensors (so the same bits), without the per-layer lookup of
    the step's plan and the dispatch around it (about 1 ms of a 13 ms SmolLM2 int4 step on a
    CPU). `plan` gives None for anything else: the caller then goes through `write_kv` and
    `decode_attention`."""

    slots: torch.Tensor
    first: int
    end: int
    longest: int
    scale: float

    @classmethod
    def plan(
        cls,
        k_cache: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> LoneDecode | None:
        """The plan of a decode step over `k_cache` (contiguous, as the bound calls require)
        whose one row's pages are consecutive and whose one slot is not padding, else None."""
        if seq_lens.shape[0] != 1 or slot_mapping.shape[0] != 1 or not k_cache.is_contiguous():
            return None
        num_pages, page_size = k_cache.shape[:2]
        _, longest, _, first = _STEP_MEMO.lookup(
            ("decode", page_table, seq_lens),
            (1, num_pages, page_size),
            lambda: _decode_plan(page_table[:1], seq_lens, num_pages, page_size),
        )
        slots, keep = _STEP_MEMO.lookup(("slots", slot_mapping), (), lambda: _slots(slot_mapping))
        if first is None or keep is not None:
            return None
        return cls.over(k_cache, slots, first, longest)

    @classmethod
    def over(
        cls, k_cache: torch.Tensor, slots: torch.Tensor, first: int, longest: int
    ) -> LoneDecode:
        """The plan of a sequence of `longest` positions in the consecutive pages of `k_cache`
        from page `first` on, writing its new K/V to int64 slots `slots` (what `plan` found;
        also what worker/decode_graph.py's compiled layer traces, with symbolic ints)."""
        end = first + cdiv(longest, k_cache.shape[1])
        return cls(slots, first, end, longest, softmax_scale_or_default(None, k_cache.shape[3]))

    def write(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        _copy_to_slots(k_cache, v_cache, k, v, self.slots)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [1, q_heads, head_dim] over the sequence's keys (`decode_attention`'s in-place
        window): [1, q_heads, head_dim]."""
        k = _window(k_cache, self.first, self.end, self.longest)
        v = _window(v_cache, self.first, self.end, self.longest)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        attended = sdpa(q.unsqueeze(2), k, v, scale=self.scale, enable_gqa=True)
        return attended.squeeze(2)


def _window(cache: torch.Tensor, first: int, end: int, longest: int) -> torch.Tensor:
    """Pages first..end - 1 of a contiguous cache as one sequence's [1, kv_heads, longest,
    head_dim] keys or values, in place: the shape and strides of its gathered pages, sliced and
    transposed, made by one `as_strided` (four views took 3 % of an int4 decode step). A
    strided cache is refused, not read past."""
    if not cache.is_contiguous():
        raise ValueError("a sequence's pages are read in place only from a contiguous cache")
    _, page_size, kv_heads, dim = cache.shape
    row = kv_heads * dim
    shape, strides = (1, kv_heads, longest, dim), ((end - first) * page_size * row, dim, row, 1)
    return cache.as_strided(shape, strides, cache.storage_offset() + first * page_size * row)


def _decode_plan(
    page_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int
) -> tuple[torch.Tensor, int, tuple[torch.Tensor, torch.Tensor] | None, int | None]:
    """What every layer of a decode step shares: each row's pages up to the longest row (ids
    past a row's own clamped into range: the masks hide what they hold) as one int64 index, the
    longest length, when rows differ in length the padding positions to zero in the gathered
    [batch, heads, longest, dim] K/V and SDPA's [batch, 1, 1, longest] mask of real ones (None:
    every row is the longest), and, for one row whose pages are consecutive ids, the first of
    them (None: gather)."""
    longest = int(seq_lens.max())
    pages = page_table[:, : cdiv(longest, page_size)].reshape(-1).to(torch.int64)
    pages = pages.clamp(0, num_pages - 1)
    if not bool((seq_lens != longest).any()):
        first = None
        if page_table.shape[0] == 1 and pages.numel() and bool((pages.diff() == 1).all()):
            first = int(pages[0])
        return pages, longest, None, first
    valid = torch.arange(longest, device=seq_lens.device)[None, :] < seq_lens[:, None]
    return pages, longest, (~valid[:, None, :, None], valid[:, None, None, :]), None


class _StepMemo:
    """The last value computed from a step's batch tensors, for the layers after the first.

    Every layer of a forward pass passes the same `page_table`, `seq_lens` and `slot_mapping`
    objects; what is derived from them alone (int64 slots, the page index, the mask) is the same
    for all of them, so it is computed once a step instead of once a layer (about 20 small ops a
    layer fewer on a decode step). A hit needs the very same tensor objects (held here, so their
    ids cannot be reused), unmodified since (their version counters, which every in-place write,
    through any view, bumps), and the same `extra` key; tensors made under inference mode have
    no version counter and are never memoised. One entry per kind; entries are replaced
    whole, so a reader never sees half of one."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[Any, ...]] = {}

    def lookup(self, tensors: tuple[Any, ...], extra: tuple[int, ...], compute: Any) -> Any:
        kind, sources = tensors[0], tensors[1:]
        if any(t.is_inference() for t in sources):  # no version counter to trust: recompute
            return compute()
        versions = tuple(t._version for t in sources)
        entry = self.entries.get(kind)
        if (
            entry is not None
            and len(entry[0]) == len(sources)
            and all(a is b for a, b in zip(entry[0], sources, strict=True))
            and entry[1] == versions
            and entry[2] == extra
        ):
            return entry[3]
        value = compute()
        self.entries[kind] = (sources, versions, extra, value)
        return value


_STEP_MEMO = _StepMemo()
