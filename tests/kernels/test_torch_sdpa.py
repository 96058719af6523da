"""The CPU serving path (torch SDPA) against the float64 reference on poisoned paged batches."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    append_prefill_attention,
    choose_backend,
    decode_attention,
    empty_kv_cache,
    reference,
    write_kv,
)
from tests.kernels.helpers import assert_close, fresh_seed, make_batch, poisoned_like
from tests.kernels.test_decode import decode_batch
from tests.kernels.test_decode import oracle as decode_oracle
from tests.kernels.test_prefill import image_regions, oracle, ragged_lengths

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("page_size", (1, 16, 64))
def test_prefill_matches_reference(page_size: int, group: int, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    q_lens, k_lens = ragged_lengths(seed)
    batch = make_batch(
        seed, q_lens, k_lens, page_size=page_size, kv_heads=2, group=group, head_dim=32,
        dtype=dtype, device=CPU,
    )  # fmt: skip
    regions = torch.tensor(image_regions(seed, q_lens, k_lens), dtype=torch.int32)
    for region_rows in (None, regions):
        out = poisoned_like(batch.q)
        append_prefill_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.cu_seqlens_q,
            batch.seq_lens_k, image_regions=region_rows, out=out, backend="torch_sdpa",
        )  # fmt: skip
        detail = f"page_size={page_size} group={group} regions={region_rows is not None}"
        assert_close(out, oracle(batch, region_rows), seed, "prefill(torch_sdpa)", detail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("page_size", (1, 16, 64))
def test_decode_matches_reference(page_size: int, group: int, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    batch = decode_batch(seed, page_size, group, dtype, CPU)
    out = poisoned_like(batch.q)
    decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.page_table, batch.seq_lens_k, out=out,
        backend="torch_sdpa",
    )  # fmt: skip
    detail = f"page_size={page_size} group={group} k={batch.seq_lens_k.tolist()}"
    assert_close(out, decode_oracle(batch), seed, "decode(torch_sdpa)", detail)


def test_it_is_the_default_on_cpu_and_never_on_cuda_unless_forced() -> None:
    k_cache, _ = empty_kv_cache(4, 16, 2, 32, torch.float32)
    assert choose_backend("decode_attention", k_cache) == "torch_sdpa"
    assert choose_backend("append_prefill_attention", k_cache) == "torch_sdpa"
    assert choose_backend("write_kv", k_cache) == "torch_sdpa"
    meta = empty_kv_cache(4, 16, 2, 32, torch.float32, device="meta")[0]
    for operation in ("decode_attention", "append_prefill_attention", "write_kv"):
        assert choose_backend(operation, meta) == "reference"  # not CPU, not CUDA: unforced
    assert choose_backend("decode_attention", meta, backend="torch_sdpa") == "torch_sdpa"


def test_write_kv_matches_reference_and_skips_padding() -> None:
    generator = torch.Generator().manual_seed(fresh_seed())
    shape = (6, 4, 2, 8)
    ours = [torch.full(shape, float("nan")) for _ in range(2)]
    theirs = [torch.full(shape, float("nan")) for _ in range(2)]
    k, v = torch.randn(5, 2, 8, generator=generator), torch.randn(5, 2, 8, generator=generator)
    slots = torch.tensor([9, -1, 22, 4, -1])
    write_kv(*ours, k, v, slots, backend="torch_sdpa")
    write_kv(*theirs, k, v, slots, backend="reference")
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert int(torch.isfinite(ours[0]).sum()) == 3 * 2 * 8


def test_what_a_step_shares_is_recomputed_when_its_tensors_change() -> None:
    """The per-step memo (page index, mask, int64 slots) is reused only for the very same,
    unmodified tensors: a page table or lengths changed in place, or equal values in new
    tensors, give the reference's answer for what they now hold."""
    seed = fresh_seed()
    batch = decode_batch(seed, 4, 2, torch.float32, CPU)
    args = (batch.q, batch.k_cache, batch.v_cache)

    def check(detail: str) -> None:
        out = decode_attention(*args, batch.page_table, batch.seq_lens_k, backend="torch_sdpa")
        assert_close(out, decode_oracle(batch), seed, "decode(torch_sdpa)", detail)

    check("first call")
    check("same tensors again")
    batch.page_table[0, 0] = batch.page_table[3, 0]  # in place: the version moves
    check("a page changed in place")
    batch.seq_lens_k[3] -= 1
    check("a length shortened in place")
    batch.page_table = batch.page_table.clone()
    batch.seq_lens_k = batch.seq_lens_k.clone()
    check("new tensors, equal values")

    k_cache, v_cache = empty_kv_cache(8, 4, 2, 16, torch.float32)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, -1, 9], dtype=torch.int32)
    write_kv(k_cache, v_cache, k, v, slots, backend="torch_sdpa")
    slots[1] = 20  # in place: now the second token is written too
    write_kv(k_cache, v_cache, k * 2, v * 2, slots, backend="torch_sdpa")
    flat = k_cache.view(-1, 2, 16)
    assert torch.equal(flat[5], k[0] * 2) and torch.equal(flat[20], k[1] * 2)
    assert torch.equal(flat[9], k[2] * 2)


@pytest.mark.parametrize("page_size", (1, 16))
@pytest.mark.parametrize("length", (1, 17, 40))
def test_a_lone_sequence_on_consecutive_pages_is_read_in_place_with_the_gathers_bits(
    page_size: int, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sequence decoding alone on pages 3, 4, 5, ...: its K/V are the cache's own pages,
    sliced, not gathered (no `index_select`). The output must be the gather's bit for bit: the
    same K/V on scattered pages, which take the gather, at the same batch size (a batch of two
    takes it too, and agrees to float32's last bits: SDPA's CPU kernels may block a batch of
    two differently, as on an AMD EPYC host); and agree with the reference. The slots past its
    length hold NaN, which neither path may read."""
    from kernels.torch_sdpa import _decode_plan

    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    n_pages = -(-length // page_size)
    num_pages, kv_heads, group, dim = n_pages + 8, 2, 3, 16
    shape = (num_pages, page_size, kv_heads, dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for cache in (k_cache, v_cache):
        written = cache.view(-1, kv_heads, dim)[3 * page_size : 3 * page_size + length]
        written.copy_(torch.randn(length, kv_heads, dim, generator=gen))
    q = torch.randn(1, kv_heads * group, dim, generator=gen)
    seq_lens = torch.tensor([length], dtype=torch.int32)
    in_order = torch.arange(3, 3 + n_pages, dtype=torch.int32)[None]
    scattered = torch.tensor([num_pages - 1 - i for i in range(n_pages)], dtype=torch.int32)[None]
    assert _decode_plan(in_order, seq_lens, num_pages, page_size)[3] == 3
    assert n_pages == 1 or _decode_plan(scattered, seq_lens, num_pages, page_size)[3] is None
    assert _decode_plan(in_order, seq_lens * 0, num_pages, page_size)[3] is None  # no pages

    gathers = []
    index_select = torch.Tensor.index_select

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        gathers.append(self.shape)
        return index_select(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    in_place = decode_attention(q, k_cache, v_cache, in_order, seq_lens, backend="torch_sdpa")
    assert gathers == []
    twice = decode_attention(
        q.repeat(2, 1, 1), k_cache, v_cache, in_order.repeat(2, 1), seq_lens.repeat(2),
        backend="torch_sdpa",
    )  # fmt: skip
    assert len(gathers) == 2
    torch.testing.assert_close(twice, in_place.repeat(2, 1, 1), rtol=1e-6, atol=1e-6)
    k_scattered, v_scattered = (
        torch.full_like(k_cache, float("nan")),
        torch.full_like(v_cache, float("nan")),
    )
    for i, page in enumerate(scattered[0].tolist()):
        k_scattered[page], v_scattered[page] = k_cache[3 + i], v_cache[3 + i]
    gathered = decode_attention(
        q, k_scattered, v_scattered, scattered, seq_lens, backend="torch_sdpa"
    )
    assert len(gathers) == (2 if n_pages == 1 else 4)  # one page is consecutive: in place too
    assert torch.equal(in_place, gathered)
    expected = reference.decode_attention(
        q.double(), k_cache.double(), v_cache.double(), in_order, seq_lens
    )
    torch.testing.assert_close(in_place.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", (1, 17, 40))
def test_a_lone_decode_planned_once_gives_write_kv_and_decode_attentions_bits(
    length: int, dtype: torch.dtype
) -> None:
    """`LoneDecode`, planned once for a step's layers, writes the new token's K/V where
    `write_kv` does and attends as `decode_attention` does, bit for bit, layer after layer (the
    caches views into one buffer, as an engine may hold them); it plans nothing for two
    sequences, scattered pages, a padding slot or a strided cache, and will not read one."""
    from kernels.torch_sdpa import LoneDecode

    gen = torch.Generator().manual_seed(fresh_seed())
    page_size, kv_heads, group, dim = 16, 2, 3, 16
    n_pages = -(-length // page_size)
    num_pages = n_pages + 6
    shape = (num_pages, page_size, kv_heads, dim)
    pages = torch.arange(2, 2 + n_pages, dtype=torch.int32)[None]
    seq_lens = torch.tensor([length], dtype=torch.int32)
    slot = torch.tensor([2 * page_size + length - 1], dtype=torch.int32)
    caches = []
    whole = torch.full((3, 2, *shape), float("nan"), dtype=dtype)  # one buffer, views of it
    for layer in range(3):  # three layers
        k_cache, v_cache = whole[layer]
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, dim)[2 * page_size : 2 * page_size + length - 1] = torch.randn(
                length - 1, kv_heads, dim, generator=gen
            )
        caches.append((k_cache, v_cache))
    lone = LoneDecode.plan(caches[0][0], pages, seq_lens, slot)
    assert lone is not None
    for k_cache, v_cache in caches:
        q = torch.randn(1, kv_heads * group, dim, generator=gen).to(dtype)
        k, v = torch.randn(2, 1, kv_heads, dim, generator=gen).to(dtype)
        theirs = k_cache.clone(), v_cache.clone()
        write_kv(*theirs, k, v, slot, backend="torch_sdpa")
        want = decode_attention(q, *theirs, pages, seq_lens, backend="torch_sdpa")
        lone.write(k_cache, v_cache, k, v)
        assert torch.equal(k_cache.nan_to_num(), theirs[0].nan_to_num())
        assert torch.equal(v_cache.nan_to_num(), theirs[1].nan_to_num())
        assert torch.equal(lone.attend(q, k_cache, v_cache), want)
    k_cache = caches[0][0]
    two = pages.repeat(2, 1), seq_lens.repeat(2), slot.repeat(2)
    assert LoneDecode.plan(k_cache, *two) is None
    if n_pages > 1:
        assert LoneDecode.plan(k_cache, pages.flip(-1), seq_lens, slot) is None
    assert LoneDecode.plan(k_cache, pages, seq_lens, slot * 0 - 1) is None
    strided = torch.empty(*shape[:3], 2 * dim, dtype=dtype)[..., :dim]
    assert LoneDecode.plan(strided, pages, seq_lens, slot) is None
    with pytest.raises(ValueError, match="contiguous"):
        lone.attend(q, k_cache, strided)
