"""The contract as the engine uses it, on each backend: write a chunk's K/V, attend; chunks in a row
equal one pass; decode equals the last row of a prefill; shared prefix pages serve two sequences."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import append_prefill_attention, decode_attention, prefill_slot_mapping, write_kv
from tests.kernels.helpers import assert_close, fresh_seed, generator, randn

KV_HEADS, GROUP, HEAD_DIM = 2, 4, 32


@pytest.fixture(params=["reference", "triton"])
def backend_device(request: pytest.FixtureRequest) -> tuple[str, torch.device]:
    if request.param == "triton":
        return "triton", request.getfixturevalue("triton_device")
    return "reference", torch.device("cpu")


def prefill_chunk(
    backend: str, caches: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
) -> torch.Tensor:  # fmt: skip
    """Write positions start .. start+len(q) of sequence 0 and attend over 0 .. start+len(q)."""
    device = q.device
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=device)
    lens = torch.tensor([start + q.shape[0]], dtype=torch.int32, device=device)
    slots = prefill_slot_mapping(table, cu, lens, caches[0].shape[1])
    write_kv(caches[0], caches[1], k, v, slots, backend=backend)
    return append_prefill_attention(q, caches[0], caches[1], table, cu, lens, backend=backend)


def shuffled_table(
    gen: torch.Generator, pages: int, num_pages: int, device: torch.device
) -> torch.Tensor:
    return (torch.randperm(num_pages - 1, generator=gen)[:pages] + 1).to(
        device=device, dtype=torch.int32
    )[None]


def test_chunks_in_a_row_equal_one_pass(backend_device: tuple[str, torch.device]) -> None:
    backend, device = backend_device
    seed = fresh_seed()
    gen, rng = generator(seed), random.Random(seed)
    length, page_size = rng.randint(40, 130), rng.choice((1, 16))
    cuts = sorted(rng.sample(range(1, length), 2))
    q, k, v = (
        randn(gen, length, h, HEAD_DIM, dtype=torch.float32, device=device)
        for h in (KV_HEADS * GROUP, KV_HEADS, KV_HEADS)
    )
    num_pages = 2 * (length // page_size + 2)
    table = shuffled_table(gen, length // page_size + 1, num_pages, device)
    shape = (num_pages, page_size, KV_HEADS, HEAD_DIM)
    one = [torch.full(shape, float("nan"), device=device) for _ in range(2)]
    whole = prefill_chunk(backend, (one[0], one[1]), table, q, k, v, 0)
    chunked = [torch.full(shape, float("nan"), device=device) for _ in range(2)]
    parts = [
        prefill_chunk(backend, (chunked[0], chunked[1]), table, q[a:b], k[a:b], v[a:b], a)
        for a, b in zip([0, *cuts], [*cuts, length], strict=True)
    ]
    assert_close(
        torch.cat(parts), whole.double(), seed, "chunked_prefill", f"{backend} cuts={cuts}"
    )
    last = decode_attention(
        q[-1:],
        chunked[0],
        chunked[1],
        table,
        torch.tensor([length], dtype=torch.int32, device=device),
        backend=backend,
    )
    assert_close(last, whole[-1:].double(), seed, "decode_vs_prefill", backend)


def test_shared_prefix_pages_serve_two_sequences(backend_device: tuple[str, torch.device]) -> None:
    """Two page-table rows point at the same prefix pages (a prefix-cache hit); the answer equals
    the float64 reference on a layout where the second sequence owns private copies of them."""
    backend, device = backend_device
    seed = fresh_seed()
    gen = generator(seed)
    page_size, suffix = 16, [5, 11]
    shape = (12, page_size, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (randn(gen, *shape, dtype=torch.float32, device=device) for _ in range(2))
    shared = torch.tensor([[7, 2, 9, 4, 0], [7, 2, 9, 11, 0]], dtype=torch.int32, device=device)
    q = randn(gen, sum(suffix), KV_HEADS * GROUP, HEAD_DIM, dtype=torch.float32, device=device)
    cu = torch.tensor([0, suffix[0], sum(suffix)], dtype=torch.int32, device=device)
    lens = torch.tensor([3 * page_size + n for n in suffix], dtype=torch.int32, device=device)
    got = append_prefill_attention(q, k_cache, v_cache, shared, cu, lens, backend=backend)
    private_k, private_v = k_cache.double().cpu(), v_cache.double().cpu()
    for page, copy in ((7, 3), (2, 5), (9, 6)):
        private_k[copy], private_v[copy] = private_k[page], private_v[page]
    private = torch.tensor([[7, 2, 9, 4, 0], [3, 5, 6, 11, 0]], dtype=torch.int32)
    expected = append_prefill_attention(
        q.double().cpu(), private_k, private_v, private, cu.cpu(), lens.cpu(), backend="reference"
    )
    assert_close(got, expected, seed, "shared_prefix", backend)
