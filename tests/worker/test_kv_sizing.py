"""The KV pool's size when `num_pages` is left out (worker/kv_sizing.py): a byte budget on
either device, vLLM's `gpu_memory_utilization` rule on CUDA, the CPU default; the heaviest step
run once to measure its activations; and the refusals, which name the key and the numbers."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from worker import kv_sizing
from worker.engine import Engine, EngineConfig
from worker.kv_sizing import CPU_PAGES, DeviceMemory, device_pool
from worker.loader import LoadedModel, load_model
from worker.logprobs import prompt_logprobs
from worker.lora_serving import adapter_slots
from worker.lora_weights import GROUP_OF, GROUPS, stack_bytes
from worker.metrics import EngineCollector
from worker.model_runner import Chunk, ModelRunner
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams

from .helpers import drain

SMALL = {"page_size": 4, "max_running": 4, "token_budget": 64, "max_prefill_chunk": 32}


def _engine(tiny: LoadedModel, **config: object) -> Engine:
    return Engine(tiny.model, tiny.tokenizer, EngineConfig(**{**SMALL, **config}))  # type: ignore[arg-type]


def _pool_pages(engine: Engine) -> int:
    stats = engine.stats()
    return stats.free_pages + stats.cached_pages + stats.private_pages + 1  # the null page


def test_a_page_count_given_is_the_pool(tiny: LoadedModel) -> None:
    engine = _engine(tiny, num_pages=40)
    assert (engine.pool.pages, engine.pool.reason) == (40, "engine.num_pages")
    assert _pool_pages(engine) == 40 == engine.runner.kv[0][0].shape[0]


def test_a_cpu_worker_without_a_count_gets_the_cpu_default(tiny: LoadedModel) -> None:
    engine = _engine(tiny)
    assert engine.config.num_pages == CPU_PAGES == _pool_pages(engine)
    assert engine.pool.reason == "the CPU default"


def test_a_byte_budget_gets_the_whole_pages_it_holds(tiny: LoadedModel) -> None:
    page = tiny.model.kv_page_bytes(4)
    engine = _engine(tiny, kv_cache_memory_bytes=100 * page + page - 1)
    assert engine.pool.pages == 100 == _pool_pages(engine) == engine.runner.kv[0][0].shape[0]
    assert engine.config.num_pages == 100 and engine.config.kv_cache_memory_bytes is None
    assert engine.pool.bytes == 100 * page
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, "w"))
    metrics = generate_latest(registry).decode()
    assert f'radixmesh_worker_kv_pool_bytes{{worker="w"}} {float(100 * page)}' in metrics
    assert engine.max_model_len == 99 * 4  # the context is cut to what the pool holds
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = tuple(range(1, 200))
    engine.submit(GenerateRequest("r", prompt_token_ids=prompt, sampling=sampling), lambda _: None)
    assert drain(engine) > 0
    assert _pool_pages(engine) == 100  # every page accounted for after serving


def test_a_byte_budget_under_two_pages_is_refused_with_the_numbers(tiny: LoadedModel) -> None:
    page = tiny.model.kv_page_bytes(4)
    with pytest.raises(
        ValueError,
        match=rf"kv_cache_memory_bytes: {2 * page - 1:,} bytes hold 1 pages of {page:,} bytes; "
        r"the pool needs at least 2 \(page 0 is reserved\)",
    ):
        _engine(tiny, kv_cache_memory_bytes=2 * page - 1)
    assert _engine(tiny, kv_cache_memory_bytes=2 * page).pool.pages == 2


def test_a_byte_budget_past_the_machines_memory_is_refused_naming_it(tiny: LoadedModel) -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(
        ValueError, match=r"^engine\.kv_cache_memory_bytes and engine\.host_pages: "
    ):
        _engine(tiny, kv_cache_memory_bytes=2 * memory)


@pytest.mark.parametrize("value", [1.5, 0, True])
def test_a_byte_budget_that_is_not_a_positive_int_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes must be an int >= 1"):
        EngineConfig(kv_cache_memory_bytes=value)  # type: ignore[arg-type]


def test_a_count_and_a_byte_budget_together_are_refused() -> None:
    with pytest.raises(ValueError, match="num_pages and kv_cache_memory_bytes are both set"):
        EngineConfig(num_pages=64, kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.01])
def test_a_utilization_outside_0_to_1_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got"):
        EngineConfig(gpu_memory_utilization=fraction)


GB = 10**9


@given(
    total=st.integers(1 * GB, 200 * GB),
    used=st.floats(0.0, 1.0),
    activations=st.integers(0, 4 * GB),
    reserved=st.integers(0, GB),
    utilization=st.floats(0.01, 1.0),
    page=st.integers(1, 4 << 20),
)
def test_the_device_pool_fills_what_the_fraction_leaves(
    total: int, used: float, activations: int, reserved: int, utilization: float, page: int
) -> None:  # fmt: skip
    memory = DeviceMemory(total, int(total * used), activations)
    budget = int(total * utilization) - memory.in_use - activations - reserved
    try:
        pool = device_pool(memory, utilization, page, reserved)
    except ValueError as err:
        assert max(budget, 0) // page < 2
        assert str(err).startswith(f"engine.gpu_memory_utilization: {utilization} of the device")
        assert f"leave room for {max(budget, 0) // page} KV pages of {page:,} bytes" in str(err)
        assert "the pool needs at least 2" in str(err)
        return
    assert pool.pages >= 2
    # everything the worker holds stays within the fraction, and one more page would not
    assert memory.in_use + activations + reserved + pool.bytes <= total * utilization
    assert memory.in_use + activations + reserved + pool.bytes + page > int(total * utilization)


@pytest.mark.parametrize(
    ("budget", "chunk", "running", "rows", "pages"),
    [
        (40, 32, 4, [32, 8], 8 + 2),  # the budget fills with two scored prompts
        (64, 16, 2, [16, 16], 4 + 4),  # two running sequences at most
        (24, 32, 8, [24], 6),  # one chunk, the budget's
    ],
)
def test_the_probe_step_scores_the_heaviest_step_and_lets_its_pool_go(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, budget: int, chunk: int, running: int,
    rows: list[int], pages: int,
) -> None:  # fmt: skip
    """On a CPU nothing is measured, but the step is the one run on CUDA: the token budget
    filled with scored prompt chunks, as many as may run, every row scored, on a pool of its
    own that nothing keeps once it returns (a kept pool would be counted as in use, and the
    pool shrunk by it)."""
    built: list[weakref.ref[ModelRunner]] = []
    steps: list[list[int]] = []
    scored: list[int] = []
    init, run = ModelRunner.__init__, ModelRunner.run

    def recording_init(self: ModelRunner, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(weakref.ref(self))

    def recording_run(self: ModelRunner, chunks: list[Chunk]) -> torch.Tensor:
        logits = run(self, chunks)
        steps.append([len(c.token_ids) for c in chunks if c.every_row])
        assert logits.shape[0] == sum(len(c.token_ids) for c in chunks)
        return logits

    def recording_scores(rows: torch.Tensor, tokens: list[int], top: int) -> object:
        scored.append(rows.shape[0])
        return prompt_logprobs(rows, tokens, top)

    monkeypatch.setattr(ModelRunner, "__init__", recording_init)
    monkeypatch.setattr(ModelRunner, "run", recording_run)
    monkeypatch.setattr(kv_sizing, "prompt_logprobs", recording_scores)
    settings = {"token_budget": budget, "max_prefill_chunk": chunk, "max_running": running}
    config = EngineConfig(**{**SMALL, **settings})  # type: ignore[arg-type]
    pool = kv_sizing.probe_step(tiny.model, config)
    assert steps == [rows] and scored == rows
    assert pool == (pages + 1) * tiny.model.kv_page_bytes(4)  # and the null page
    gc.collect()
    assert len(built) == 1 and built[0]() is None  # nothing keeps the probe's pool alive


def test_the_lora_slots_are_reserved_as_loading_adapters_will_allocate_them(
    tiny: LoadedModel,
) -> None:
    """Adapters loaded module by module in the worst order (each load repacks its group for
    one more module, old stacks held beside the new until copied, the group with the largest
    old stacks last): the most ever held is what was reserved, to the byte."""
    _, stacks = adapter_slots(tiny.model, 2, 8)
    assert stacks is not None and stacks.nbytes == 0
    reserved = kv_sizing.lora_reserve(tiny.model, stacks)
    assert kv_sizing.lora_reserve(tiny.model, None) == 0

    def old_part(members: tuple[str, ...]) -> int:
        return stack_bytes(tiny.model.config, 2, 8, tiny.model.dtype, members[:-1])

    peak = 0
    for members in sorted(GROUPS.values(), key=old_part):  # the largest repack last
        for n in range(1, len(members) + 1):
            before = stacks.nbytes
            stacks._allocate(GROUP_OF[members[0]], members[:n])
            new = stack_bytes(tiny.model.config, 2, 8, tiny.model.dtype, members[:n])
            peak = max(peak, before + new)  # the old stacks go only once the copy is done
            assert stacks.nbytes == before - (old_part(members[:n]) if n > 1 else 0) + new
    assert peak == reserved
    assert kv_sizing.lora_reserve(tiny.model, stacks) == reserved - stacks.nbytes


@pytest.mark.gpu
def test_on_cuda_the_pool_fills_the_fraction_and_the_heaviest_step_fits(
    tiny: LoadedModel,
) -> None:
    """The real measurement: after the pool is allocated and a scored prompt of a whole
    chunk has run, the device holds no more than the fraction (and not much less)."""
    loaded = load_model(tiny.path, torch.bfloat16, "cuda")
    fraction = 0.1
    config = EngineConfig(
        page_size=16, max_running=8, token_budget=1024, max_prefill_chunk=512,
        gpu_memory_utilization=fraction, model_revision=loaded.revision,
    )  # fmt: skip
    engine = Engine(loaded.model, loaded.tokenizer, config)
    try:
        assert "engine.gpu_memory_utilization 0.1" in engine.pool.reason
        sampling = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=20)
        for name in ("p", "q"):  # two scored prompts of a chunk each: one step of 1,024 rows
            prompt = (1,) * 512
            request = GenerateRequest(name, prompt_token_ids=prompt, sampling=sampling)
            engine.submit(request, lambda _: None)
        assert drain(engine) > 0
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        assert total - free <= fraction * total + (256 << 20)  # the allocator's rounding
        assert total - free >= fraction * total - (1 << 30)
    finally:  # the next CUDA tests get the device back
        del engine, loaded
        gc.collect()
        torch.cuda.empty_cache()
