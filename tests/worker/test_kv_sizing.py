"""The KV pool's size when `num_pages` is left out (worker/kv_sizing.py): a byte budget on
either device, vLLM's `gpu_memory_utilization` rule on CUDA, the CPU default; the heaviest step
run once to measure its activations; and the refusals, which name the key and the numbers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from worker.engine import Engine, EngineConfig
from worker.kv_sizing import CPU_PAGES, DeviceMemory, device_pool, probe_step
from worker.loader import LoadedModel, load_model
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


def test_the_probe_step_runs_a_scored_chunk_and_decodes_and_lets_its_pool_go(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU nothing is measured, but the step is the one run on CUDA: a chunk of 32 scored
    rows and 3 decode rows (4 running, 40 tokens of budget), on a pool of its own that nothing
    keeps once it returns (a kept pool would be counted as in use, and the pool shrunk by it)."""
    built: list[weakref.ref[ModelRunner]] = []
    rows: list[int] = []
    init, run = ModelRunner.__init__, ModelRunner.run

    def recording_init(self: ModelRunner, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        built.append(weakref.ref(self))

    def recording_run(self: ModelRunner, chunks: list[Chunk]) -> torch.Tensor:
        logits = run(self, chunks)
        rows.append(logits.shape[0])
        return logits

    monkeypatch.setattr(ModelRunner, "__init__", recording_init)
    monkeypatch.setattr(ModelRunner, "run", recording_run)
    config = EngineConfig(**{**SMALL, "token_budget": 40})  # type: ignore[arg-type]
    pool = probe_step(tiny.model, config)
    assert rows == [32 + 3]
    page = tiny.model.kv_page_bytes(4)
    assert pool == (8 + 2) * page  # the chunk's 8 pages, the null page, the decode rows' page
    gc.collect()
    assert len(built) == 1 and built[0]() is None  # nothing keeps the probe's pool alive


@pytest.mark.gpu
def test_on_cuda_the_pool_fills_the_fraction_and_the_heaviest_step_fits(
    tiny: LoadedModel,
) -> None:
    """The real measurement: after the pool is allocated and a scored prompt of a whole
    chunk has run, the device holds no more than the fraction (and not much less)."""
    loaded = load_model(tiny.path, torch.bfloat16, "cuda")
    fraction = 0.1
    config = EngineConfig(
        page_size=16, max_running=8, token_budget=512, max_prefill_chunk=512,
        gpu_memory_utilization=fraction, model_revision=loaded.revision,
    )  # fmt: skip
    engine = Engine(loaded.model, loaded.tokenizer, config)
    try:
        assert "engine.gpu_memory_utilization 0.1" in engine.pool.reason
        sampling = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=20)
        prompt = (1,) * 512
        request = GenerateRequest("p", prompt_token_ids=prompt, sampling=sampling)
        engine.submit(request, lambda _: None)
        assert drain(engine) > 0
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        assert total - free <= fraction * total + (64 << 20)
        assert total - free >= fraction * total - (1 << 30)
    finally:  # the next CUDA tests get the device back
        del engine, loaded
        gc.collect()
        torch.cuda.empty_cache()
