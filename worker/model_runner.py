"""Runs the model for the engine: owns the paged KV tensors and builds each step's batch.

The engine hands over `Chunk`s (the tokens of one sequence to compute this step, where they
start, the sequence's page row, whether its next token is sampled); the runner lays them end to
end into a `ForwardBatch`, performs pending page copies, and returns the logits of the sampling
rows (every row of a chunk whose prompt is scored, for prompt logprobs). It never touches the
cache's bookkeeping: page rows come from `cache.PageTable`.

With LoRA stacks (worker/lora_weights.py) a chunk may name the adapter slot its rows use; the
batch then carries the adapter segments, adjacent chunks of one slot merged into one segment
(the engine orders its chunks by slot so that there are few). When every chunk is -1 there are
no segments and the step is the base model's.

A chunk over a vision prompt's image positions carries their input embeddings (its rows'
offsets in the chunk and one row each, from worker/image_inputs.py); the batch gathers them
into `embed_rows` / `embeds`, which replace those rows' token embeddings.

With a host tier it also owns the host KV tensors (CPU memory, pinned when the device is CUDA)
and performs the cache's `TierCopy`s through a `KvCopier` (worker/kv_copies.py): layer by layer
in the order the cache queued them, on CUDA on a copy stream whose per-layer events the forward
pass waits on, so a promotion's later layers move while its first layers compute. A `SpillCopy`
(a node eviction dropped that the disk tier keeps) reads the node's pages to the CPU and hands
them to `spill`. Anything else that touches the KV (`read_pages`, `write_pages`) first waits for
the copies issued before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cache import PageCopy
from cache.page_pool import PageIds
from cache.tiers import DEVICE, QueuedCopy, SpillCopy
from kernels.layout import cdiv
from worker.batch import ForwardBatch
from worker.kv_copies import MIN_STREAM_BYTES, KvCopier, page_index
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
    every_row: bool = field(default=False, kw_only=True)
    """Whether logits are wanted at every token of the chunk (a prompt being scored)."""
    drafted: int = field(default=0, kw_only=True)
    """Draft tokens after the chunk's first (speculative decoding, worker/speculation.py):
    logits are wanted at every token."""

    @property
    def rows(self) -> int:
        """Rows of logits the chunk gets."""
        if self.every_row or self.drafted:
            return len(self.token_ids)
        return int(self.sample)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        host_pages: int = 0,
        lora: LoraStacks | None = None,
        copy_stream: bool = True,
        copy_stream_min_bytes: int = MIN_STREAM_BYTES,
    ) -> None:
        self.model = model
        self.lora = lora
        self.page_size = page_size
        self.device = model.model.embed_tokens.weight.device
        self.kv = model.allocate_kv(num_pages, page_size, self.device)
        self.host_kv = model.allocate_kv(host_pages, page_size, "cpu") if host_pages else []
        if self.device.type == "cuda":
            self.host_kv = [(k.pin_memory(), v.pin_memory()) for k, v in self.host_kv]
        self.copier = KvCopier(self.kv, self.host_kv, copy_stream, copy_stream_min_bytes)
        self.spill: Callable[[object, torch.Tensor, torch.Tensor], None] | None = None
        """Takes a `SpillCopy`'s token and the K and V of its pages (`read_pages`' shapes)."""
        self.spill_lost: Callable[[object], None] | None = None
        """Takes the token of a `SpillCopy` never performed (a copy before it failed)."""
        if model.flat_decode:
            model.decode_layers()  # a CPU int4 model starts building its decode graphs now

    def copy_pages(self, copies: Sequence[PageCopy | QueuedCopy]) -> None:
        """Perform the copies in order (worker/kv_copies.py; on CUDA on the copy stream that
        the next forward pass waits on layer by layer): a `PageCopy` copies KV slots [0, n) of
        page src into page dst on the device; a `TierCopy` copies whole pages between the
        tiers; a `SpillCopy` reads whole pages for `spill`. Every layer, K and V."""
        if not copies:  # most steps
            return
        spilled = 0

        def spill(copy: SpillCopy) -> None:
            nonlocal spilled
            if self.spill is None:
                raise RuntimeError("a spill copy and no spill to take it")
            self.spill(copy.token, *self.read_pages(copy.tier, copy.pages))
            spilled += 1

        try:
            self.copier.perform(copies, spill)
        except BaseException:
            lost = [c.token for c in copies if isinstance(c, SpillCopy)][spilled:]
            if self.spill_lost is not None:
                for token in lost:
                    self.spill_lost(token)
            raise

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's K and V over every layer (the same in either tier)."""
        return self.copier.page_bytes

    def read_pages(self, tier: int, pages: PageIds) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages` of `tier`, every layer, on the CPU: [layers, pages, page_size,
        kv_heads, head_dim] each."""
        kv = self.copier.tier_kv(tier)
        if tier == DEVICE:
            self.copier.join()
        else:
            self.copier.host_sync()
        index = page_index(pages, kv[0][0].device)
        k = torch.stack([layer_k.index_select(0, index) for layer_k, _ in kv]).cpu()
        v = torch.stack([layer_v.index_select(0, index) for _, layer_v in kv]).cpu()
        return k, v

    def write_pages(self, pages: PageIds, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write `read_pages`-shaped K and V into device `pages`."""
        self.copier.join()
        index = page_index(pages, self.device)
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
            if chunk.every_row or chunk.drafted:
                sample_rows.extend(range(cu[-2], cu[-1]))
            elif chunk.sample:
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
        """Compute the chunks' K/V; float32 logits in chunk order: a row for each sampling
        chunk's last token, and for every token of an `every_row` or drafted chunk."""
        return self.model.logits(self.hidden_states(chunks))

    def run_pooled(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """`run`'s logits and, row for row, the final hidden states they were read from (an
        embedding request's output: worker/pooling.py)."""
        hidden = self.hidden_states(chunks)
        return self.model.logits(hidden), hidden

    def hidden_states(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        batch = self.build_batch(chunks)
        if not self.copier.pending:
            return self.model.hidden_states(batch, self.kv, self.lora)
        ready = self.copier.layer_ready
        hidden = self.model.hidden_states(batch, self.kv, self.lora, layer_ready=ready)
        self.copier.forward_done()
        return hidden


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
