"""Runs the model for the engine: owns the paged KV tensors and builds each step's batch.

The engine hands over `Chunk`s (the tokens of one sequence to compute this step, where they
start, the sequence's page row, whether its next token is sampled); the runner lays them end to
end into a `ForwardBatch`, performs pending page copies, and returns the logits of the sampling
rows. It never touches the cache's bookkeeping: page rows come from `cache.PageTable`.

With LoRA stacks (worker/lora_weights.py) a chunk may name the adapter slot its rows use; the
batch then carries the adapter segments, adjacent chunks of one slot merged into one segment
(the engine orders its chunks by slot so that there are few). When every chunk is -1 there are
no segments and the step is the base model's.

A chunk over a vision prompt's image positions carries their input embeddings (its rows'
offsets in the chunk and one row each, from worker/image_inputs.py); the batch gathers them
into `embed_rows` / `embeds`, which replace those rows' token embeddings.

With a host tier it also owns the host KV tensors (CPU memory, pinned when the device is CUDA)
and performs the cache's `TierCopy`s: a gather of whole pages per layer on one side, a scatter
on the other, in the order the cache queued them. A `SpillCopy` (a node eviction dropped that
the disk tier keeps) reads the node's pages to the CPU and hands them to `spill`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cache import PageCopy
from cache.page_pool import PageIds
from cache.tiers import DEVICE, QueuedCopy, SpillCopy, TierCopy
from kernels.layout import cdiv
from worker.batch import ForwardBatch
from worker.lora_weights import LoraStacks
from worker.model import CausalLM


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: Sequence[int]
    start: int
    """Position of the first token: the sequence's KV [0, start) is already in its pages."""
    pages: Sequence[int]
    """The sequence's page row (covering at least start + len(token_ids) positions)."""
    sample: bool
    """Whether logits are wanted at the chunk's last token."""
    lora_slot: int = -1
    """The LoRA stacks' slot of the sequence's adapter; -1: the base model."""
    embed_offsets: Sequence[int] = ()
    """Offsets in `token_ids` of the image positions, whose embeddings are `embeds`."""
    embeds: torch.Tensor | None = None
    """[len(embed_offsets), hidden] the input embeddings of those positions."""


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        host_pages: int = 0,
        lora: LoraStacks | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.page_size = page_size
        self.device = model.model.embed_tokens.weight.device
        self.kv = model.allocate_kv(num_pages, page_size, self.device)
        self.host_kv = model.allocate_kv(host_pages, page_size, "cpu") if host_pages else []
        if self.device.type == "cuda":
            self.host_kv = [(k.pin_memory(), v.pin_memory()) for k, v in self.host_kv]
        self.spill: Callable[[object, torch.Tensor, torch.Tensor], None] | None = None
        """Takes a `SpillCopy`'s token and the K and V of its pages (`read_pages`' shapes)."""
        self.spill_lost: Callable[[object], None] | None = None
        """Takes the token of a `SpillCopy` never performed (a copy before it failed)."""

    def copy_pages(self, copies: Sequence[PageCopy | QueuedCopy]) -> None:
        """Perform the copies in order: a `PageCopy` copies KV slots [0, n) of page src into
        page dst on the device; a `TierCopy` copies whole pages between the tiers; a
        `SpillCopy` reads whole pages for `spill`. Every layer, K and V."""
        for done, copy in enumerate(copies):
            try:
                self._copy(copy)
            except BaseException:
                lost = [c.token for c in copies[done:] if isinstance(c, SpillCopy)]
                if self.spill_lost is not None:
                    for token in lost:
                        self.spill_lost(token)
                raise

    def _copy(self, copy: PageCopy | QueuedCopy) -> None:
        if isinstance(copy, TierCopy):
            self._copy_tier(copy)
        elif isinstance(copy, SpillCopy):
            if self.spill is None:
                raise RuntimeError("a spill copy and no spill to take it")
            self.spill(copy.token, *self.read_pages(copy.tier, copy.pages))
        else:
            for k_cache, v_cache in self.kv:
                k_cache[copy.dst, : copy.num_slots] = k_cache[copy.src, : copy.num_slots]
                v_cache[copy.dst, : copy.num_slots] = v_cache[copy.src, : copy.num_slots]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's K and V over every layer (the same in either tier)."""
        k = self.kv[0][0]
        return 2 * len(self.kv) * k[0].numel() * k.element_size()

    def tier_kv(self, tier: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (k, v) per layer of `tier`'s pages."""
        kv = self.kv if tier == DEVICE else self.host_kv
        if not kv:
            raise RuntimeError("a copy to or from a host tier this runner does not have")
        return kv

    def _copy_tier(self, copy: TierCopy) -> None:
        """Whole pages from one tier to the other, every layer's K and V. Across devices (a GPU
        and its pinned host tier): a promotion copies each run of consecutive host pages of
        each layer straight into a staging tensor on the GPU (pinned memory: the copies do not
        make the CPU wait, and the stream orders them before the kernels that read the pages),
        or, past MAX_PROMOTION_RUNS runs, gathers the pages into one pinned tensor and moves it
        in one such transfer; a demotion gathers on the GPU and moves everything back in one
        transfer, which waits; either side then scatters into its pages. On an H100 the earlier
        way, a gather of each layer into pageable host memory and a transfer of it alone, added
        7.8 ms to a 1,024-token prompt's host hit (34 MB, a Llama-3.2-1B-shaped model); a
        gather into one pinned tensor and one transfer 5.7 ms; runs copied straight 1.9 ms."""
        src, dst = self.tier_kv(copy.src_tier), self.tier_kv(copy.dst_tier)
        src_device, dst_device = src[0][0].device, dst[0][0].device
        src_index = _page_index(copy.src_pages, src_device)
        dst_index = _page_index(copy.dst_pages, dst_device)
        sources = [t for pair in src for t in pair]
        targets = [t for pair in dst for t in pair]
        if src_device == dst_device:
            for source, target in zip(sources, targets, strict=True):
                target.index_copy_(0, dst_index, source.index_select(0, src_index))
            return
        first = sources[0]
        shape = (len(sources), len(copy.src_pages), *first.shape[1:])
        runs = page_runs(copy.src_pages) if src_device.type == "cpu" else []
        if runs and len(runs) <= MAX_PROMOTION_RUNS:  # runs of pinned pages straight to the GPU
            moved = torch.empty(shape, dtype=first.dtype, device=dst_device)
            for at, start, count in runs:
                for i, source in enumerate(sources):
                    moved[i, at : at + count].copy_(source[start : start + count], True)
        else:  # one gather on the source side (pinned on the host), one transfer
            host = src_device.type == "cpu"
            staging = torch.empty(shape, dtype=first.dtype, device=src_device, pin_memory=host)
            for i, source in enumerate(sources):
                torch.index_select(source, 0, src_index, out=staging[i])
            moved = staging.to(dst_device, non_blocking=host)  # a demotion waits for its copy
        for i, target in enumerate(targets):
            target.index_copy_(0, dst_index, moved[i])

    def read_pages(self, tier: int, pages: PageIds) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages` of `tier`, every layer, on the CPU: [layers, pages, page_size,
        kv_heads, head_dim] each."""
        kv = self.tier_kv(tier)
        index = _page_index(pages, kv[0][0].device)
        k = torch.stack([layer_k.index_select(0, index) for layer_k, _ in kv]).cpu()
        v = torch.stack([layer_v.index_select(0, index) for _, layer_v in kv]).cpu()
        return k, v

    def write_pages(self, pages: PageIds, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `read_pages`-shaped K and V into device `pages`."""
        index = _page_index(pages, self.device)
        for layer, (k_cache, v_cache) in enumerate(self.kv):
            k_cache.index_copy_(0, index, k[layer].to(self.device, k_cache.dtype))
            v_cache.index_copy_(0, index, v[layer].to(self.device, v_cache.dtype))

    def build_batch(self, chunks: Sequence[Chunk]) -> ForwardBatch:
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        lens_k: list[int] = []
        sample_rows: list[int] = []
        embed_rows: list[int] = []
        embeds: list[torch.Tensor] = []
        width = max(cdiv(c.start + len(c.token_ids), ps) for c in chunks)
        table = torch.zeros((len(chunks), width), dtype=torch.int32)
        for i, chunk in enumerate(chunks):
            end = chunk.start + len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            span = range(chunk.start, end)
            positions.extend(span)
            row = chunk.pages
            slots.extend(row[p // ps] * ps + p % ps for p in span)
            used = cdiv(end, ps)
            table[i, :used] = torch.tensor(row[:used], dtype=torch.int32)
            if chunk.embeds is not None:
                _check_embeds(chunk)
                embed_rows.extend(cu[-1] + offset for offset in chunk.embed_offsets)
                embeds.append(chunk.embeds)
            cu.append(cu[-1] + len(chunk.token_ids))
            lens_k.append(end)
            if chunk.sample:
                sample_rows.append(cu[-1] - 1)
        device = self.device
        starts, seg_slots = self._segments(chunks)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            page_table=table.to(device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens_k=torch.tensor(lens_k, dtype=torch.int32, device=device),
            logits_indices=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            max_seqlen_q=max(len(c.token_ids) for c in chunks),
            lora_seg_starts=_int32(starts, device) if seg_slots else None,
            lora_seg_slots=_int32(seg_slots, device) if seg_slots else None,
            lora_slots=tuple(sorted({s for s in seg_slots if s >= 0})),
            embed_rows=torch.tensor(embed_rows, dtype=torch.int64, device=device)
            if embeds
            else None,
            embeds=_image_embeds(embeds, device) if embeds else None,
        )

    def _segments(self, chunks: Sequence[Chunk]) -> tuple[list[int], list[int]]:
        """Row offsets and slots of the adapter segments; ([0], []) when no chunk has one."""
        if all(c.lora_slot == -1 for c in chunks):
            return [0], []
        if self.lora is None:
            raise ValueError("a chunk with a LoRA slot, and this runner has no LoRA stacks")
        starts, slots = [0], list[int]()
        for chunk in chunks:
            if not -1 <= chunk.lora_slot < self.lora.max_loras:
                raise ValueError(f"LoRA slot {chunk.lora_slot} outside [-1, {self.lora.max_loras})")
            if chunk.lora_slot >= 0 and self.lora.slot_identity[chunk.lora_slot] is None:
                raise ValueError(f"LoRA slot {chunk.lora_slot} holds no adapter")
            if slots and slots[-1] == chunk.lora_slot:
                starts[-1] += len(chunk.token_ids)
            else:
                starts.append(starts[-1] + len(chunk.token_ids))
                slots.append(chunk.lora_slot)
        return starts, slots

    def run(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """Compute the chunks' K/V; float32 logits for the sampling chunks, in chunk order."""
        return self.model(self.build_batch(chunks), self.kv, self.lora)


def _check_embeds(chunk: Chunk) -> None:
    offsets, n = chunk.embed_offsets, len(chunk.token_ids)
    assert chunk.embeds is not None
    if chunk.embeds.shape[0] != len(offsets) or any(not 0 <= o < n for o in offsets):
        raise ValueError(
            f"a chunk of {n} tokens with {chunk.embeds.shape[0]} embeddings for offsets "
            f"{list(offsets)[:8]}..."
        )


def _image_embeds(pieces: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    embeds = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return embeds.to(device)


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


MAX_PROMOTION_RUNS = 8
"""Runs of host pages a promotion copies one by one (a copy call per run and per layer's K and
V); more scattered pages are gathered on the host first. Chosen, not measured: the H100 runs of
the ninth session saw only freshly demoted, consecutive pages."""


def page_runs(pages: PageIds) -> list[tuple[int, int, int]]:
    """(position in `pages`, first page, count) of each run of consecutive page ids (numpy over
    the array in place: no Python step per page)."""
    if not pages:
        return []
    ids = np.frombuffer(pages, dtype=np.int32)
    at = np.flatnonzero(np.diff(ids) != 1) + 1
    at = np.concatenate(([0], at))
    counts = np.diff(np.concatenate((at, [len(ids)])))
    return list(zip(at.tolist(), ids[at].tolist(), counts.tolist(), strict=True))


def _page_index(pages: PageIds, device: torch.device) -> torch.Tensor:
    """`pages` (an `array("i")`) as an int64 index tensor on `device` (read in place; an empty
    array, which `frombuffer` refuses, gives an empty index)."""
    if not pages:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(pages, dtype=torch.int32).to(device, torch.long)
