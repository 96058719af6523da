"""Paged-KV attention kernels: a plain-torch reference (the CPU path and test oracle) and Triton.

The engine calls the three operations below; kernels/dispatch.py checks their arguments and picks
a backend (reference, triton, flash-attn). kernels/layout.py documents the paged layout. Imports
nothing of ours; importing this package imports neither triton nor flash-attn.
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

__all__ = [
    "KernelInputError",
    "append_prefill_attention",
    "bind",
    "choose_backend",
    "decode_attention",
    "empty_kv_cache",
    "prefill_slot_mapping",
    "slots_for_positions",
    "write_kv",
]
