"""How many pages a worker's KV pool gets when the configuration leaves `num_pages` out.

- `num_pages`: that many, as given.
- `kv_cache_memory_bytes` (vLLM's `--kv-cache-memory-bytes`): the whole pages that fit in it, on
  either device.
- On CUDA, what `gpu_memory_utilization` of the device leaves (vLLM's and SGLang's rule): that
  fraction of the device's memory, less everything on the device once the model is loaded
  (its weights, the CUDA context, and any other process's memory), less the activations of the
  heaviest step the engine can schedule, less what is allocated later: the LoRA slots' stacks
  (allocated as adapters load, and a repack's old stacks beside the new) and the vision
  encoder's cache.
  The activations are measured, not guessed: that step runs once, before the pool exists, on
  a pool just large enough for it (`probe_step`).
- On a CPU, `CPU_PAGES`, the count the pool always had there; `engine.check_kv_memory` still
  refuses a pool larger than the machine's memory.

A budget that leaves no page besides the null page is refused, with the numbers. A pool too
small for a model's context cuts the context (`engine.context_length`), as a given count does.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.layout import cdiv
from worker.logprobs import prompt_logprobs
from worker.lora_weights import GROUPS, TARGET_MODULES, LoraStacks, stack_bytes
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner

if TYPE_CHECKING:  # worker/engine.py imports this module
    from worker.engine import EngineConfig

NUM_PAGES = "engine.num_pages"
CPU_PAGES = 4096
"""A CPU worker's pages when neither `num_pages` nor `kv_cache_memory_bytes` is set."""
LEAST_PAGES = 2
"""The null page and one to hold KV: what `cache.CacheConfig` accepts."""
PROBE_TOP = 20
"""Top logprobs of each scored prompt row in the probe step: the most the API asks for."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A CUDA device's memory as the pool is sized, in bytes."""

    total: int
    in_use: int
    """On the device, every process's, after the model loaded and before the pool."""
    activations: int
    """The heaviest step's peak above what was allocated before it, the probe pool excluded."""


@dataclass(frozen=True, slots=True)
class PoolSize:
    pages: int
    """Pages of the pool, the null page included."""
    page_bytes: int
    key: str
    """The setting that decides it (what a refusal names)."""
    reason: str
    """How the count was reached, for the log and `describe`."""

    @property
    def bytes(self) -> int:
        return self.pages * self.page_bytes


def size_pool(
    model: CausalLM,
    limits: EngineConfig,
    lora: LoraStacks | None = None,
    reserved: int = 0,
) -> PoolSize:
    """The pool for `model` under `limits`. `reserved`: device bytes something else will
    allocate later (the vision encoder's cache); the LoRA slots' are added here."""
    page = model.kv_page_bytes(limits.page_size)
    if limits.num_pages is not None:
        return PoolSize(limits.num_pages, page, NUM_PAGES, NUM_PAGES)
    if limits.kv_cache_memory_bytes is not None:
        pages = limits.kv_cache_memory_bytes // page
        if pages < LEAST_PAGES:
            raise ValueError(
                f"engine.kv_cache_memory_bytes: {limits.kv_cache_memory_bytes:,} bytes hold "
                f"{pages} pages of {page:,} bytes; the pool needs at least {LEAST_PAGES} (page "
                "0 is reserved)"
            )
        key = "engine.kv_cache_memory_bytes"
        return PoolSize(pages, page, key, f"{key} {_gb(pages * page)}")
    if model.model.embed_tokens.weight.device.type != "cuda":
        return PoolSize(CPU_PAGES, page, NUM_PAGES, "the CPU default")
    memory = measure_cuda(model, limits, lora)
    later = reserved + lora_reserve(model, lora)
    return device_pool(memory, limits.gpu_memory_utilization, page, later)


def device_pool(
    memory: DeviceMemory, utilization: float, page_bytes: int, reserved: int = 0
) -> PoolSize:
    """The pages that `utilization` of the device leaves after what is in use, the
    activations and `reserved`; refused below `LEAST_PAGES`."""
    allowed = int(memory.total * utilization)
    budget = allowed - memory.in_use - memory.activations - reserved
    pages = max(budget, 0) // page_bytes
    spent = (
        f"{_gb(memory.in_use)} in use after loading (weights, CUDA context, other processes), "
        f"{_gb(memory.activations)} of activations"
        + (f", {_gb(reserved)} allocated later (LoRA slots, encoder cache)" if reserved else "")
    )
    if pages < LEAST_PAGES:
        raise ValueError(
            f"engine.gpu_memory_utilization: {utilization} of the device's {_gb(memory.total)} "
            f"is {_gb(allowed)}; {spent} leave room for {pages} KV pages of {page_bytes:,} "
            f"bytes, and the pool needs at least {LEAST_PAGES}: raise it, free the device, or "
            "set engine.num_pages or engine.kv_cache_memory_bytes"
        )
    key = "engine.gpu_memory_utilization"
    return PoolSize(
        pages, page_bytes, key, f"{key} {utilization} of {_gb(memory.total)}, less {spent}"
    )


def measure_cuda(model: CausalLM, limits: EngineConfig, lora: LoraStacks | None) -> DeviceMemory:
    """Run `probe_step` on the model's CUDA device and read what it took; then what the device
    has in use with the probe's memory given back."""
    device = model.model.embed_tokens.weight.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    probe_pool = probe_step(model, limits, lora)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - probe_pool
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, total - free, max(peak, 0))


def probe_step(model: CausalLM, limits: EngineConfig, lora: LoraStacks | None = None) -> int:
    """Run the heaviest step the engine schedules, once, on a pool just large enough for it,
    and let the pool go; its bytes. The step fills `token_budget` with prompt chunks of at most
    `max_prefill_chunk` positions, at most `max_running` of them, each scored in every row as
    a request asking for its prompt's logprobs is (logits, their log-softmax and ranks, chunk
    by chunk as the engine scores them). A decode row is one such row: a step of them is no
    heavier."""
    sizes: list[int] = []
    left = limits.token_budget
    while left > 0 and len(sizes) < limits.max_running:
        sizes.append(min(limits.max_prefill_chunk, left))
        left -= sizes[-1]
    ps = limits.page_size
    pages = sum(cdiv(size, ps) for size in sizes) + 1  # and the null page
    runner = ModelRunner(model, pages, ps, lora=lora)
    chunks, first = [], 1
    for size in sizes:
        rows = range(first, first + cdiv(size, ps))
        chunks.append(Chunk([0] * size, 0, rows, True, every_row=True))
        first += len(rows)
    with torch.inference_mode():
        logits = runner.run(chunks)
        row = 0
        for size in sizes:
            prompt_logprobs(logits[row : row + size], [0] * size, PROBE_TOP)
            row += size
    pool = pages * runner.page_bytes
    del runner, logits
    return pool


def lora_reserve(model: CausalLM, lora: LoraStacks | None) -> int:
    """Device bytes the LoRA slots will take beyond what they hold now: their stacks are
    allocated group by group as adapters that target them load, and a group repacked for one
    more module holds its old stacks (one module fewer) beside the new ones until the copy is
    done (the largest such old stack, counted once)."""
    if lora is None:
        return 0
    config, dtype = model.config, model.dtype

    def size(modules: Sequence[str]) -> int:
        return stack_bytes(config, lora.max_loras, lora.max_rank, dtype, modules)

    repack = max(
        (
            size([m for m in members if m != dropped])
            for members in GROUPS.values()
            if len(members) > 1
            for dropped in members
        ),
        default=0,
    )
    return max(size(TARGET_MODULES) - lora.nbytes, 0) + repack


def _gb(n: int) -> str:
    """Bytes for a person: GB, MB below a GB."""
    return f"{n / 1e9:.2f} GB" if abs(n) >= 10**9 else f"{n / 1e6:.2f} MB"
