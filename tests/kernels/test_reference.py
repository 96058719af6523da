"""The oracle proven: the paged reference against torch SDPA on contiguous K/V with a mask built
element by element from the definition, all in float64; and the Triton launchers' horizon form of
the image-region mask against the reference's dense form."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kernels import reference
from kernels.masks import query_horizons
from tests.kernels.helpers import fresh_seed, generator, randn

CPU = torch.device("cpu")


def visible(i: int, j: int, q_len: int, k_len: int, regions: list[tuple[int, int]]) -> bool:
    """The contract, written out: right-aligned causal, or both inside one image region."""
    p = k_len - q_len + i
    return j <= p or any(s <= p < e and s <= j < e for s, e in regions)


def paged_copy(
    ks: list[torch.Tensor], vs: list[torch.Tensor], page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter contiguous [len, heads, dim] K/V sequences, position by position, into a shuffled,
    NaN-padded paged cache; return (k_cache, v_cache, page_table)."""
    pages_per_seq = [-(-k.shape[0] // page_size) for k in ks]
    num_pages = 1 + 2 * sum(pages_per_seq)
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    shape = (num_pages, page_size, *ks[0].shape[1:])
    k_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float64)
    table = torch.zeros(len(ks), max(pages_per_seq), dtype=torch.int32)
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for position in range(k.shape[0]):
            if position % page_size == 0:
                table[i, position // page_size] = order.pop()
            page, offset = table[i, position // page_size], position % page_size
            k_cache[page, offset] = k[position]
            v_cache[page, offset] = v[position]
    return k_cache, v_cache, table


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """torch's attention on [len, heads, dim] tensors, GQA by enable_gqa."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


def test_prefill_reference_matches_sdpa_on_contiguous_kv() -> None:
    seed = fresh_seed()
    gen, rng = generator(seed), random.Random(seed)
    kv_heads, group, head_dim, page_size = 2, 4, 16, rng.choice((1, 4, 16))
    k_lens = [rng.randint(1, 60) for _ in range(4)] + [40]
    q_lens = [rng.randint(1, k) for k in k_lens[:-1]] + [40]
    regions = {4: [(0, 7), (20, 31)], 0: [(0, k_lens[0])]}
    ks = [randn(gen, n, kv_heads, head_dim, dtype=torch.float64, device=CPU) for n in k_lens]
    vs = [randn(gen, n, kv_heads, head_dim, dtype=torch.float64, device=CPU) for n in k_lens]
    k_cache, v_cache, table = paged_copy(ks, vs, page_size, gen)
    q = randn(gen, sum(q_lens), kv_heads * group, head_dim, dtype=torch.float64, device=CPU)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = [(s, a, b) for s, spans in regions.items() for a, b in spans]
    got = reference.append_prefill_attention(
        q, k_cache, v_cache, table, cu, torch.tensor(k_lens, dtype=torch.int32),
        softmax_scale=0.3, image_regions=torch.tensor(rows, dtype=torch.int32),
    )  # fmt: skip
    for i, (q_len, k_len) in enumerate(zip(q_lens, k_lens, strict=True)):
        spans = regions.get(i, [])
        mask = torch.tensor(
            [[visible(a, b, q_len, k_len, spans) for b in range(k_len)] for a in range(q_len)]
        )
        expected = sdpa(q[cu[i] : cu[i + 1]], ks[i], vs[i], mask, 0.3)
        error = float((got[cu[i] : cu[i + 1]] - expected).abs().max())
        assert error < 1e-12, (
            f"sequence {i} (q {q_len}, k {k_len}): max error {error} (seed {seed})"
        )


def test_decode_reference_matches_sdpa_on_contiguous_kv() -> None:
    seed = fresh_seed()
    gen, rng = generator(seed), random.Random(seed)
    kv_heads, group, head_dim, page_size = 2, 3, 16, rng.choice((1, 8))
    lens = [1, *(rng.randint(2, 70) for _ in range(4))]
    ks = [randn(gen, n, kv_heads, head_dim, dtype=torch.float64, device=CPU) for n in lens]
    vs = [randn(gen, n, kv_heads, head_dim, dtype=torch.float64, device=CPU) for n in lens]
    k_cache, v_cache, table = paged_copy(ks, vs, page_size, gen)
    q = randn(gen, len(lens), kv_heads * group, head_dim, dtype=torch.float64, device=CPU)
    got = reference.decode_attention(
        q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)
    )
    for i, n in enumerate(lens):
        expected = sdpa(
            q[i : i + 1], ks[i], vs[i], torch.ones(1, n, dtype=torch.bool), head_dim**-0.5
        )
        error = float((got[i : i + 1] - expected).abs().max())
        assert error < 1e-12, f"sequence {i} (k {n}): max error {error} (seed {seed})"


def test_write_kv_reference_writes_exactly_the_named_slots() -> None:
    seed = fresh_seed()
    gen = generator(seed)
    k_cache = torch.full((5, 4, 2, 8), float("nan"), dtype=torch.float64)
    v_cache = k_cache.clone()
    k = randn(gen, 6, 2, 8, dtype=torch.float64, device=CPU)
    v = randn(gen, 6, 2, 8, dtype=torch.float64, device=CPU)
    slots = torch.tensor([17, 3, -1, 0, 9, -5])
    reference.write_kv(k_cache, v_cache, k, v, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 4, slot % 4], k[t]), f"token {t} -> slot {slot}"
            assert torch.equal(v_cache[slot // 4, slot % 4], v[t]), f"token {t} -> slot {slot}"
    assert int((~k_cache.isnan()).all(-1).all(-1).sum()) == 4, "exactly four slots written"


@given(
    layout=st.lists(  # (k_len, q_len) with 1 <= q_len <= k_len
        st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=4
    ).map(lambda rows: [(q_len + prefix, q_len) for q_len, prefix in rows]),
    data=st.data(),
)
def test_horizons_equal_the_dense_prefix_lm_mask(
    layout: list[tuple[int, int]], data: st.DataObject
) -> None:
    """query_horizons (the Triton form) allows exactly what reference.prefix_lm_mask allows."""
    k_lens = [k for k, _ in layout]
    q_lens = [q for _, q in layout]
    regions: list[tuple[int, int, int]] = []
    for seq, k_len in enumerate(k_lens):
        cuts = sorted(data.draw(st.sets(st.integers(0, k_len), max_size=4)))
        regions += [(seq, a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    region_tensor = torch.tensor(regions, dtype=torch.int32).reshape(-1, 3)
    horizons = query_horizons(
        cu, torch.tensor(k_lens, dtype=torch.int32), region_tensor, int(cu[-1])
    )
    for seq, (k_len, q_len) in enumerate(layout):
        spans = [(a, b) for s, a, b in regions if s == seq]
        dense = reference.prefix_lm_mask(q_len, k_len, spans, CPU)
        from_horizon = torch.arange(k_len)[None, :] <= horizons[cu[seq] : cu[seq + 1], None]
        assert torch.equal(dense, from_horizon), (
            f"sequence {seq}: regions {spans}, q {q_len}, k {k_len}"
        )
