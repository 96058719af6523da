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
from worker.kv_copies import MAX_COPY_RUNS, MIN_STREAM_BYTES, KvCopier
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
    """Each copy here reads pages the one before it wrote. On a GPU, more runs than
    MAX_COPY_RUNS take the other way across PCIe (a promotion gathers on the host, a demotion
    scatters on the CPU); on the CPU both tiers are RAM and the queue checks the order alone."""
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


DELAY_CYCLES = 200_000_000
"""About 0.1 s of `torch.cuda._sleep` on an H200: long enough that a read not ordered after the
delayed work reads what was there before it."""


def _no_spill(copy: SpillCopy) -> None:
    raise AssertionError(f"no spill was queued: {copy}")


def _gpu_copier(min_bytes: int) -> tuple[KvCopier, list, list]:
    kv = _kv(LARGE, "cuda", seed=1)
    host = _kv(LARGE, "pinned", seed=2)
    return KvCopier(kv, host, stream=True, min_stream_bytes=min_bytes), kv, host


@pytest.mark.gpu
def test_a_small_demotion_on_the_compute_stream_is_synced_before_the_cpu_reads() -> None:
    """Below the size floor a demotion's transfers go on the compute stream, while the copier
    has a copy stream too: `host_sync` must wait for the stream that wrote."""
    copier, kv, host = _gpu_copier(min_bytes=1 << 40)
    want = kv[0][0][0:4].cpu()
    torch.cuda._sleep(DELAY_CYCLES)  # the compute stream is busy; the copy stream idle
    copier.perform(
        [TierCopy(DEVICE, array("i", range(4)), HOST, array("i", range(8, 12)))], _no_spill
    )
    copier.host_sync()
    assert torch.equal(host[0][0][8:12], want), "the CPU read host pages before they were written"


@pytest.mark.gpu
def test_the_copy_stream_reads_kv_only_after_the_compute_stream_wrote_it() -> None:
    copier, kv, host = _gpu_copier(min_bytes=0)
    torch.cuda._sleep(DELAY_CYCLES)
    kv[0][0][3].fill_(7.0)  # a pass's KV write, queued behind the delay
    copier.perform([TierCopy(DEVICE, array("i", [3]), HOST, array("i", [5]))], _no_spill)
    copier.host_sync()
    assert bool((host[0][0][5] == 7.0).all()), "the demotion read the page before the write"


@pytest.mark.gpu
def test_a_copy_failing_part_way_leaves_what_was_issued_joined() -> None:
    """The second promotion names host pages past the tier's end: it fails at layer 0, after
    the first promotion's layer 0 was issued on a delayed copy stream. The compute stream must
    still see that layer's copy once the error is out."""
    copier, kv, host = _gpu_copier(min_bytes=0)
    assert copier.stream is not None
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(DELAY_CYCLES)
    good = TierCopy(HOST, array("i", range(4)), DEVICE, array("i", range(4)))
    past_the_end = TierCopy(
        HOST, array("i", range(LARGE.pages - 2, LARGE.pages + 2)), DEVICE, array("i", range(8, 12))
    )
    with pytest.raises(RuntimeError):
        copier.perform([good, past_the_end], _no_spill)
    assert not copier.pending
    seen = kv[0][0][0:4].clone()  # on the compute stream
    assert torch.equal(seen.cpu(), host[0][0][0:4]), "the compute stream read before the copy"


def test_the_config_files_default_floor_is_the_copiers() -> None:
    from cluster.config import EngineSection

    assert EngineSection().copy_stream_min_bytes == MIN_STREAM_BYTES
    assert EngineConfig().copy_stream_min_bytes == MIN_STREAM_BYTES
