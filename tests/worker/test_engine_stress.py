"""Page conservation under load: 1,000 random requests, aborts, preemption and n > 1."""

from __future__ import annotations

import random

from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA, Recorder, drain
from worker.engine import Engine, EngineConfig
from worker.request import FINISH_ABORT, GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model


def test_a_thousand_random_requests_leak_no_page() -> None:
    rng = random.Random(2026)
    model = tiny_model(LLAMA, seed=3)
    config = EngineConfig(
        num_pages=70,
        page_size=4,
        max_running=10,
        token_budget=64,
        max_prefill_chunk=24,
        max_waiting=2000,
    )
    engine = Engine(model, None, config)
    recorder = Recorder()
    prefixes = [[rng.randrange(1, 384) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    submitted: list[str] = []
    n_by_request: dict[str, int] = {}
    for i in range(1000):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 384) for _ in range(rng.randint(0, 24))]
        n = rng.choice([1, 1, 1, 2, 3])
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=0.0 if n == 1 and rng.random() < 0.5 else 0.8,
            seed=i,
            n=n,
        )
        request_id = f"r{i}"
        engine.submit(
            GenerateRequest(request_id, tuple(prompt), sampling=params), recorder.outputs.append
        )
        submitted.append(request_id)
        n_by_request[request_id] = n
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if rng.random() < 0.08:  # abort something in flight, at whatever point it has reached
            engine.abort(rng.choice(submitted[-20:]))
        if i % 100 == 0:
            check_sequence_cache(engine.cache)
    drain(engine)
    check_sequence_cache(engine.cache)
    pool = engine.cache.pool
    assert pool.num_private == 0, "pages of finished requests were not freed"
    assert pool.num_free + engine.cache.tree.cached_pages == pool.usable_pages
    assert all(node.lock_ref == 0 for node in engine.cache.tree.nodes())
    assert engine.cache.live == [] and engine.cache.table.active_slots == []
    finals = [o for o in recorder.outputs if o.finished]
    assert len(finals) == sum(n_by_request.values()), "every sample of every request finished once"
    stats = engine.stats()
    assert stats.preemptions > 0, "the small pool must force preemption"
    assert stats.cached_prompt_tokens > 0
    assert any(o.finish_reason == FINISH_ABORT for o in finals)
    assert stats.requests_finished == 1000
