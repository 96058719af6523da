"""The strongest guarantee: the cache changes what is computed, never what comes out.

For two model configs (Llama with GQA; Qwen3 with GQA 4:1, QK-norm, tied head, llama3 RoPE),
greedy tokens are identical, and the logits at the prompt's last position agree to 1e-5
relative, between a no-cache oracle that recomputes the whole sequence every step and the engine:
cold with pages of 1 and 16, after a prefix hit, after a full-prompt hit, with several prefill
chunk sizes, inside batches of different composition, and after part of the prompt's KV went
to the host tier and came back.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tests.worker.helpers import (
    LLAMA,
    QWEN3,
    drain,
    greedy,
    no_cache_greedy,
    recorded_engine,
    relative_error,
)
from worker.config import ModelConfig
from worker.engine import Engine, EngineConfig
from worker.model import CausalLM
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

STEPS = 10
_RNG = random.Random(7)
PROMPT = [_RNG.randrange(1, 384) for _ in range(48)]  # whole pages of 1, 4 and 16
MODELS: dict[str, CausalLM] = {}
ORACLE: dict[str, tuple[list[int], torch.Tensor]] = {}


def model_for(config: ModelConfig) -> CausalLM:
    key = config.architecture
    if key not in MODELS:
        MODELS[key] = tiny_model(config, seed=11)
    return MODELS[key]


def engine_config(**overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(num_pages=256, page_size=1, max_running=8, token_budget=256)
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def cold(engine: Engine) -> None:
    engine.submit(greedy("r", PROMPT, STEPS), lambda o: None)


def _run_target(engine: Engine, sink: Callable) -> None:  # type: ignore[type-arg]
    engine.submit(greedy("target", PROMPT, STEPS), sink)
    drain(engine)


def _prefix_hit(engine: Engine, sink: Callable) -> None:  # type: ignore[type-arg]
    engine.submit(greedy("warm", [*PROMPT[:30], 5, 6, 7], 3), lambda o: None)
    drain(engine)
    _run_target(engine, sink)


def _full_hit(engine: Engine, sink: Callable) -> None:  # type: ignore[type-arg]
    engine.submit(greedy("warm", PROMPT, 8), lambda o: None)  # caches whole pages past the prompt
    drain(engine)
    _run_target(engine, sink)


def _host_tier_hit(engine: Engine, sink: Callable) -> None:  # type: ignore[type-arg]
    """The warm prompt's tail is demoted to the host by a long request, then promoted back."""
    engine.submit(greedy("warm", PROMPT, 8), lambda o: None)
    drain(engine)
    rng = random.Random(5)
    engine.submit(greedy("crowd", [rng.randrange(1, 384) for _ in range(80)], 15), lambda o: None)
    drain(engine)
    assert engine.stats().demoted_pages > 0, "nothing went to the host"
    _run_target(engine, sink)
    assert engine.stats().promoted_pages > 0 and engine.stats().host_hit_tokens > 0


def _crowded_batch(engine: Engine, sink: Callable) -> None:  # type: ignore[type-arg]
    rng = random.Random(3)
    for i in range(3):
        others = [rng.randrange(1, 384) for _ in range(rng.randint(5, 60))]
        engine.submit(greedy(f"other{i}", others, 15), lambda o: None)
    engine.submit(greedy("target", PROMPT, STEPS), sink)
    drain(engine)


def _joins_mid_decode(engine: Engine, sink: Callable) -> None:  # type: ignore[type-arg]
    engine.submit(greedy("early", [*PROMPT[:20], 9, 9], 20), lambda o: None)
    engine.submit(greedy("other", list(range(3, 50)), 20), lambda o: None)
    for _ in range(4):
        engine.step()
    _run_target(engine, sink)


SCENARIOS = {
    "paged-page1": (engine_config(), _run_target),
    "paged-page16": (engine_config(page_size=16, num_pages=32), _run_target),
    "prefix-hit": (engine_config(page_size=4, num_pages=128), _prefix_hit),
    "full-prompt-hit-page1": (engine_config(), _full_hit),
    "full-prompt-hit-page16": (engine_config(page_size=16, num_pages=32), _full_hit),
    "chunk-1": (engine_config(max_prefill_chunk=1), _run_target),
    "chunk-7": (engine_config(max_prefill_chunk=7, page_size=4, num_pages=64), _run_target),
    "chunk-16-budget-20": (engine_config(max_prefill_chunk=16, token_budget=20), _run_target),
    "crowded-batch": (engine_config(page_size=4, num_pages=128), _crowded_batch),
    "host-tier-hit": (engine_config(page_size=4, num_pages=32, host_pages=64), _host_tier_hit),
    "joins-mid-decode": (
        engine_config(page_size=16, num_pages=64, token_budget=24),
        _joins_mid_decode,
    ),
}


def oracle(config: ModelConfig) -> tuple[list[int], torch.Tensor]:
    """The no-cache oracle's greedy tokens and first logits, on the CPU."""
    if config.architecture not in ORACLE:
        ORACLE[config.architecture] = no_cache_greedy(model_for(config), PROMPT, STEPS)
    return ORACLE[config.architecture]


def check_scenario(model: CausalLM, config: ModelConfig, scenario: str) -> None:
    expected_tokens, expected_logits = oracle(config)
    engine_cfg, run = SCENARIOS[scenario]
    engine, recorder = recorded_engine(model, engine_cfg)
    run(engine, recorder.outputs.append)
    got = [t for o in recorder.outputs if o.request_id == "target" for t in o.token_ids]
    assert got == expected_tokens
    first = recorder.logits[("target", 0, len(PROMPT))].cpu()
    assert relative_error(first, expected_logits) < 1e-5
    if "hit" in scenario:
        assert recorder.final("target").cached_prompt_tokens > 0
    assert engine.cache.pool.num_private == 0


@pytest.mark.parametrize("config", [LLAMA, QWEN3], ids=["llama-gqa", "qwen3-qknorm"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_engine_matches_the_no_cache_oracle(config: ModelConfig, scenario: str) -> None:
    check_scenario(model_for(config), config, scenario)


CUDA_MODELS: dict[str, CausalLM] = {}


@pytest.mark.gpu
@pytest.mark.parametrize("config", [LLAMA, QWEN3], ids=["llama-gqa", "qwen3-qknorm"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_engine_on_cuda_matches_the_cpu_oracle(config: ModelConfig, scenario: str) -> None:
    """Every scenario with the model on a GPU: the Triton kernels compiled (prefill, decode, KV
    write), the host tier pinned, against the oracle computed on the CPU (float32 both ways;
    torch keeps TF32 off for float32 matmuls by default)."""
    key = config.architecture
    if key not in CUDA_MODELS:
        CUDA_MODELS[key] = tiny_model(config, seed=11).to("cuda")
    check_scenario(CUDA_MODELS[key], config, scenario)


@pytest.mark.parametrize("page_size", [1, 16])
def test_full_prompt_hit_reuses_all_but_the_last_position(page_size: int) -> None:
    config = engine_config(page_size=page_size, num_pages=512 // page_size)
    engine, recorder = recorded_engine(model_for(LLAMA), config)
    _full_hit(engine, recorder.outputs.append)
    assert recorder.final("target").cached_prompt_tokens == len(PROMPT) - 1


def test_a_prompt_ending_inside_a_page_reuses_only_whole_pages() -> None:
    engine, recorder = recorded_engine(model_for(LLAMA), engine_config(page_size=16, num_pages=32))
    engine.submit(greedy("warm", PROMPT, 8), lambda o: None)
    drain(engine)
    engine.submit(greedy("short", PROMPT[:45], 2), recorder.outputs.append)
    drain(engine)
    assert recorder.final("short").cached_prompt_tokens == 32


@pytest.mark.parametrize("config", [LLAMA, QWEN3], ids=["llama-gqa", "qwen3-qknorm"])
def test_seeded_sampling_repeats_run_to_run_and_across_batches(config: ModelConfig) -> None:
    model = model_for(config)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=1234, n=3)
    request = GenerateRequest("s", prompt_token_ids=tuple(PROMPT), sampling=params)
    runs = []
    for crowd in (0, 0, 3):
        engine, recorder = recorded_engine(model, engine_config(page_size=4, num_pages=160))
        for i in range(crowd):
            engine.submit(greedy(f"c{i}", PROMPT[i : i + 30], 8), lambda o: None)
        engine.submit(request, recorder.outputs.append)
        drain(engine)
        runs.append([recorder.tokens("s", index) for index in range(3)])
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(sample) for sample in runs[0]}) == 3, "the n samples must differ"
    unseeded = SamplingParams(max_tokens=12, temperature=0.9, n=1)
    tokens = set()
    for _ in range(3):
        engine, recorder = recorded_engine(model, engine_config())
        engine.submit(
            GenerateRequest("u", tuple(PROMPT), sampling=unseeded), recorder.outputs.append
        )
        drain(engine)
        tokens.add(tuple(recorder.tokens("u")))
    assert len(tokens) > 1, "without a seed, runs must differ"


def test_n_samples_share_the_prompt_pages() -> None:
    engine, recorder = recorded_engine(model_for(LLAMA), engine_config(page_size=4, num_pages=64))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=4)
    prompt = PROMPT[:46]  # 11 whole pages of 4 and a partial one
    engine.submit(GenerateRequest("n", tuple(prompt), sampling=params), recorder.outputs.append)
    while not any(o.request_id == "n" and o.index == 3 for o in recorder.outputs):
        engine.step()
    rows = [list(engine.cache.table.row(s.seq.slot)) for s in engine.scheduler.running if s.seq]
    assert len(rows) == 4
    shared = len(prompt) // 4
    assert all(row[:shared] == rows[0][:shared] for row in rows)
    assert len({row[shared] for row in rows}) == 4, "the partial last page is copied, not shared"
    drain(engine)
    assert all(recorder.final("n", i).finish_reason == "length" for i in range(4))
    assert engine.cache.pool.num_private == 0


def test_logits_of_every_step_match_the_oracle() -> None:
    model = model_for(QWEN3)
    engine, recorder = recorded_engine(model, engine_config(page_size=4, num_pages=64))
    _run_target(engine, recorder.outputs.append)
    tokens = list(PROMPT) + recorder.tokens("target")
    for step in range(STEPS):
        position = len(PROMPT) + step
        _, oracle = no_cache_greedy(model, tokens[:position], 1)
        got = recorder.logits[("target", 0, position)]
        assert relative_error(got, oracle) < 1e-5, f"step {step}"
    assert torch.equal(torch.tensor(recorder.tokens("target")), torch.tensor(tokens[len(PROMPT) :]))
