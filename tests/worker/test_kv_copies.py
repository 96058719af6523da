"""The KV copier issues a queue of copies layer by layer (worker/kv_copies.py): whatever the queue,
the KV it leaves, and the pages each spill reads, are those of performing the copies one after
the other, whole. On the CPU both tiers are RAM; on a GPU (marked `gpu`) the host tier is pinned,
promotions and demotions move runs or gathered pages across PCIe, on the copy stream or on the
compute stream, and what the compute stream reads after `layer_ready` / `join` must be the
finished copies: pages are large there, so a missing wait would read stale bytes."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import PageCopy
from cache.tiers import DEVICE, HOST, SpillCopy, TierCopy
from tests.worker.helpers import LLAMA, drain, greedy, recorded_engine
from worker.engine import EngineConfig
from worker.kv_copies import MAX_COPY_RUNS, KvCopier
from worker.tiny_model import tiny_model


@dataclass(frozen=True)
class Shape:
    layers: int
    pages: int
    page_size: int
    heads: int
    dim: int


SMALL = Shape(layers=3, pages=24, page_size=2, heads=1, dim=2)
LARGE = Shape(layers=6, pages=48, page_size=64, heads=8, dim=128)  # 128 KB a page a layer


def _pages(draw: st.DrawFn, count: int, limit: int) -> array:
    """`count` distinct page ids below `limit`: consecutive runs or scattered ones."""
    if draw(st.booleans()):
        first = draw(st.integers(0, limit - count))
        return array("i", range(first, first + count))
    return array("i", draw(st.permutations(range(limit)))[:count])


@st.composite
def queues(draw: st.DrawFn, shape: Shape) -> list[PageCopy | TierCopy | SpillCopy]:
    copies: list[PageCopy | TierCopy | SpillCopy] = []
    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["promote", "demote", "page", "spill"]))
        if kind == "page":
            src, dst = draw(st.permutations(range(shape.pages)))[:2]
            slots = draw(st.integers(1, shape.page_size))
            copies.append(PageCopy(src, dst, slots))
            continue
        count = draw(st.integers(1, shape.pages // 2))
        if kind == "spill":
            tier = draw(st.sampled_from([DEVICE, HOST]))
            copies.append(SpillCopy(tier, _pages(draw, count, shape.pages), token=i))
            continue
        src, dst = (HOST, DEVICE) if kind == "promote" else (DEVICE, HOST)
        copies.append(
            TierCopy(src, _pages(draw, count, shape.pages), dst, _pages(draw, count, shape.pages))
        )
    return copies


def _kv(shape: Shape, device: str, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    size = (shape.pages, shape.page_size, shape.heads, shape.dim)
    kv = [
        (torch.randn(size, generator=gen), torch.randn(size, generator=gen))
        for _ in range(shape.layers)
    ]
    if device == "cuda":
        return [(k.to("cuda"), v.to("cuda")) for k, v in kv]
    if device == "pinned":
        return [(k.pin_memory(), v.pin_memory()) for k, v in kv]
    return kv


def _reference(
    kv: list[tuple[torch.Tensor, torch.Tensor]],
    host: list[tuple[torch.Tensor, torch.Tensor]],
    copies: list[PageCopy | TierCopy | SpillCopy],
) -> dict[object, tuple[torch.Tensor, torch.Tensor]]:
    """Perform `copies` on CPU clones one by one, whole: the tiers end as they should, and the
    pages each spill should read."""
    tiers = {DEVICE: kv, HOST: host}
    spilled = {}
    for copy in copies:
        if isinstance(copy, PageCopy):
            for pair in kv:
                for t in pair:
                    t[copy.dst, : copy.num_slots] = t[copy.src, : copy.num_slots].clone()
        elif isinstance(copy, TierCopy):
            src, dst = tiers[copy.src_tier], tiers[copy.dst_tier]
            for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
                for s, d in zip(copy.src_pages, copy.dst_pages, strict=True):
                    dk[d], dv[d] = sk[s].clone(), sv[s].clone()
        else:
            pages = list(copy.pages)
            k = torch.stack([layer_k[pages] for layer_k, _ in tiers[copy.tier]])
            v = torch.stack([layer_v[pages] for _, layer_v in tiers[copy.tier]])
            spilled[copy.token] = (k, v)
    return spilled


def _check(
    shape: Shape, copies: list, device: str, stream: bool, seed: int, min_bytes: int = 0
) -> None:
    kv = _kv(shape, "cuda" if device == "cuda" else "cpu", seed)
    host = _kv(shape, "pinned" if device == "cuda" else "cpu", seed + 1)
    want_kv = [(k.cpu().clone(), v.cpu().clone()) for k, v in kv]
    want_host = [(k.clone(), v.clone()) for k, v in host]
    want_spills = _reference(want_kv, want_host, copies)
    copier = KvCopier(kv, host, stream=stream, min_stream_bytes=min_bytes)
    spills: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}

    def spill(copy: SpillCopy) -> None:  # as ModelRunner.read_pages: wait, then read
        (copier.join if copy.tier == DEVICE else copier.host_sync)()
        index = torch.tensor(list(copy.pages), dtype=torch.long)
        pairs = copier.tier_kv(copy.tier)
        k = torch.stack([layer_k[index.to(layer_k.device)] for layer_k, _ in pairs]).cpu()
        v = torch.stack([layer_v[index.to(layer_v.device)] for _, layer_v in pairs]).cpu()
        spills[copy.token] = (k, v)

    copier.perform(copies, spill)
    # what a forward pass sees: each layer read on the compute stream right after its wait
    seen = []
    for layer in range(shape.layers):
        copier.layer_ready(layer)
        seen.append(tuple(t.clone() for t in kv[layer]))
    copier.forward_done()
    copier.host_sync()
    for layer, ((k, v), (wk, wv)) in enumerate(zip(seen, want_kv, strict=True)):
        assert torch.equal(k.cpu(), wk) and torch.equal(v.cpu(), wv), f"device layer {layer}"
    for layer, ((k, v), (wk, wv)) in enumerate(zip(host, want_host, strict=True)):
        assert torch.equal(k, wk) and torch.equal(v, wv), f"host layer {layer}"
    assert spills.keys() == want_spills.keys()
    for token, (k, v) in spills.items():
        assert torch.equal(k, want_spills[token][0]) and torch.equal(v, want_spills[token][1])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_layer_by_layer_copies_equal_the_copies_one_by_one(data: st.DataObject) -> None:
    copies = data.draw(queues(SMALL))
    _check(SMALL, copies, "cpu", stream=True, seed=data.draw(st.integers(0, 1 << 16)))


ON_EACH_DEVICE = [
    ("cpu", True),
    pytest.param("cuda", True, marks=pytest.mark.gpu, id="cuda-copy-stream"),
    pytest.param("cuda", False, marks=pytest.mark.gpu, id="cuda-compute-stream"),
]


@pytest.mark.parametrize(("device", "stream"), ON_EACH_DEVICE)
def test_scattered_and_consecutive_pages_cross_over_in_order(device: str, stream: bool) -> None:
    """More runs than MAX_COPY_RUNS take the other way across PCIe (a promotion gathers on the
    host, a demotion scatters on the CPU); each copy here reads pages the one before it wrote."""
    n = MAX_COPY_RUNS + 1
    scattered = array("i", range(0, 2 * n, 2))
    copies = [
        TierCopy(DEVICE, array("i", range(n)), HOST, scattered),
        TierCopy(HOST, scattered, DEVICE, array("i", range(20, 20 + n))),
        TierCopy(DEVICE, array("i", range(20, 20 + n)), HOST, array("i", range(1, 1 + n))),
        TierCopy(HOST, array("i", range(1, 1 + n)), DEVICE, array("i", range(n))),
        SpillCopy(HOST, scattered, token="scattered"),
    ]
    shape = LARGE if device == "cuda" else Shape(2, 48, 2, 1, 2)
    _check(shape, copies, device, stream, seed=5)


LARGE_PAGE = 2 * LARGE.layers * LARGE.page_size * LARGE.heads * LARGE.dim * 4  # float32


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("stream", "min_pages"),
    [(True, 0), (False, 0), (True, 8)],
    ids=["copy-stream", "compute-stream", "both-by-size"],
)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_on_a_gpu_the_compute_stream_reads_finished_copies(
    stream: bool, min_pages: int, data: st.DataObject
) -> None:
    """both-by-size: segments moving fewer than 8 pages go on the compute stream, the others on
    the copy stream, so one queue uses both."""
    copies = data.draw(queues(LARGE))
    seed = data.draw(st.integers(0, 1 << 16))
    _check(LARGE, copies, "cuda", stream, seed, min_bytes=min_pages * LARGE_PAGE)


@pytest.mark.gpu
def test_on_a_gpu_the_copy_stream_changes_no_output_under_tier_churn() -> None:
    """Twelve conversations of three turns through a device pool that holds about two of them:
    every turn demotes and promotes. Greedy tokens and the cache's counters are the same with
    the copy stream, without it, and on the CPU."""
    model = tiny_model(LLAMA, seed=3)
    rng = torch.Generator().manual_seed(4)
    chats = [torch.randint(1, 384, (40,), generator=rng).tolist() for _ in range(12)]
    runs = {}
    for name, device, stream in (
        ("cpu", "cpu", True),
        ("off", "cuda", False),
        ("on", "cuda", True),
    ):
        config = EngineConfig(
            num_pages=48,
            page_size=4,
            max_running=4,
            host_pages=512,
            copy_stream=stream,
            copy_stream_min_bytes=0,  # every tier copy on the stream: the tiny model's are small
        )
        engine, recorder = recorded_engine(model.to(device), config)
        tokens = []
        for turn in range(3):
            for i, chat in enumerate(chats):
                engine.submit(greedy(f"c{i}t{turn}", chat, 4), recorder.outputs.append)
                if i % 3 == 2:
                    drain(engine)
            drain(engine)
            for i, chat in enumerate(chats):
                said = recorder.tokens(f"c{i}t{turn}")
                tokens.append(said)
                chat.extend([*said, 5 + turn])
        stats = engine.stats()
        runs[name] = (tokens, stats.promoted_pages, stats.demoted_pages, stats.host_hit_tokens)
        for chat in chats:
            del chat[40:]
    assert runs["cpu"][1] > 0 and runs["cpu"][2] > 0, "the workload moved no pages"
    assert runs["on"] == runs["off"] == runs["cpu"]
