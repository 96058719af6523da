"""One model step over a flattened, unpadded batch: what the engine hands the model.

The tokens of every sequence in the step are laid end to end:

    input_ids     [ a5 a6 a7 | b9 | c0 c1 c2 c3 ]      T = 8 tokens this step
    positions     [  5  6  7 |  9 |  0  1  2  3 ]      their positions in their sequences
    cu_seqlens_q  [0, 3, 4, 8]                          sequence i owns rows cu[i]:cu[i+1]
    seq_lens_k    [8, 10, 4]                            KV length of each sequence after the step
    slot_mapping  [ ... T slots ... ]                  where each token's K/V is written
    page_table    [3, max_pages] int32                 row i: the pages of sequence i
    logits_indices [2, 3, 7]                           rows whose next-token logits are wanted

A sequence's query chunk is always the last `cu[i+1] - cu[i]` of its `seq_lens_k[i]` positions
(right-aligned causal attention over cached + new KV). A step whose chunks all have length 1 is a
pure decode step and may use the decode kernel.

A step that serves LoRA adapters also cuts its rows into segments of one adapter slot each
(`kernels.lora`; adjacent sequences of one slot share a segment, -1 is the base model):

    lora_seg_starts [0, 3, 4, 8]                        segment g owns rows starts[g]:starts[g+1]
    lora_seg_slots  [2, -1, 0]                          its adapter slot
    lora_slots      (0, 2)                              the distinct slots >= 0, on the host

A step without adapters has no segments (None) and runs exactly as the base model.

A step over image positions (a vision prompt's runs of image tokens) carries their embeddings,
the vision connector's outputs, which replace the token embeddings of those rows:

    embed_rows    [ 1 2 ]                               rows of the flat batch
    embeds        [2, hidden]                           their input embeddings
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor
    """[T] int64 token ids whose KV this step computes."""
    positions: torch.Tensor
    """[T] int64 position of each token in its sequence (RoPE)."""
    slot_mapping: torch.Tensor
    """[T] int64 KV slot (page * page_size + offset) of each token."""
    page_table: torch.Tensor
    """[B, max_pages] int32 page rows of the B sequences, in batch order."""
    cu_seqlens_q: torch.Tensor
    """[B + 1] int32 offsets of each sequence's tokens in the flat batch."""
    seq_lens_k: torch.Tensor
    """[B] int32 KV length of each sequence once this step's tokens are written."""
    logits_indices: torch.Tensor
    """[S] int64 rows of the flat batch whose logits are computed (usually each chunk's last)."""
    max_seqlen_q: int
    """The longest chunk (a launch-size hint)."""
    lora_seg_starts: torch.Tensor | None = None
    """[G + 1] int32 row offsets of the adapter segments, or None: no adapter this step."""
    lora_seg_slots: torch.Tensor | None = None
    """[G] int32 adapter slot of each segment (-1: none)."""
    lora_slots: tuple[int, ...] = ()
    """The distinct slots >= 0 in `lora_seg_slots`, known on the host (read from the tensor when
    empty)."""
    embed_rows: torch.Tensor | None = None
    """[M] int64 rows whose input embedding is given in `embeds` (image positions), or None."""
    embeds: torch.Tensor | None = None
    """[M, hidden] the model's dtype: the input embeddings of `embed_rows`."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_k.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one token."""
        return self.max_seqlen_q == 1
