"""Paged-KV attention and LoRA kernels: a plain-torch reference (the oracle), CPU paths, Triton.

The engine calls the three attention operations below; kernels/dispatch.py checks their arguments
and picks a backend (reference, torch_sdpa, triton, flash-attn). kernels/layout.py documents the
paged layout. LoRA's shrink / expand over segments of rows (kernels/lora.py) check and dispatch
the same way. Imports nothing of ours; importing this package imports neither triton nor
flash-attn.
"""

from kernels.dispatch import (
    append_prefill_attention,
    bind,
    choose_backend,
    decode_attention,
    write_kv,
)
from kernels.errors import KernelInputError
from kernels.layout import empty_kv_cache, prefill_slot_mapping, slots_for_positions
from kernels.lora import choose_lora_backend, lora_expand, lora_shrink
from kernels.torch_sdpa import LoneDecode

__all__ = [
    "KernelInputError",
    "LoneDecode",
    "append_prefill_attention",
    "bind",
    "choose_backend",
    "choose_lora_backend",
    "decode_attention",
    "empty_kv_cache",
    "lora_expand",
    "lora_shrink",
    "prefill_slot_mapping",
    "slots_for_positions",
    "write_kv",
]
