"""The host tier in the engine: evicted KV goes to host memory and comes back for a later
request, with the same outputs as a cold run, and the numbers show in stats and Prometheus."""

from __future__ import annotations

import itertools
import random
from array import array

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA, drain, greedy, recorded_engine
from worker.engine import EngineConfig
from worker.kv_copies import page_runs
from worker.metrics import EngineCollector
from worker.servicer import worker_stats
from worker.tiny_model import tiny_model

RNG = random.Random(21)
CONVERSATION = [RNG.randrange(1, 384) for _ in range(64)]
OTHERS = [[RNG.randrange(1, 384) for _ in range(60)] for _ in range(3)]


def _serve(host_pages: int) -> tuple[list[int], dict[str, int], object]:
    """A conversation, three other prompts that push it out of the device pool, then the
    conversation's next turn; returns the next turn's tokens, its cached prompt tokens and the
    engine."""
    model = tiny_model(LLAMA, seed=3)
    config = EngineConfig(num_pages=40, page_size=4, max_running=4, host_pages=host_pages)
    engine, recorder = recorded_engine(model, config)
    engine.submit(greedy("turn1", CONVERSATION, 4), lambda o: None)
    drain(engine)
    for i, prompt in enumerate(OTHERS):
        engine.submit(greedy(f"other{i}", prompt, 8), lambda o: None)
        drain(engine)
    engine.submit(greedy("turn2", [*CONVERSATION, 7, 8, 9], 6), recorder.outputs.append)
    drain(engine)
    check_sequence_cache(engine.cache)
    final = recorder.final("turn2")
    counts = {"cached": final.cached_prompt_tokens, "host": final.host_cached_tokens}
    return recorder.tokens("turn2"), counts, engine


def test_a_turn_pushed_out_of_the_device_comes_back_from_the_host() -> None:
    cold_tokens, cold, _ = _serve(host_pages=0)
    tokens, warm, engine = _serve(host_pages=128)
    assert tokens == cold_tokens, "the host tier changed an output"
    assert cold["cached"] == 0, "without a host tier the conversation was evicted"
    assert warm["cached"] == 64, "every whole page of the conversation came back"
    assert (warm["host"], cold["host"]) == (64, 0), "the output says where its hit came from"
    stats = engine.stats()  # type: ignore[attr-defined]
    assert stats.host_hit_tokens == 64 and stats.promoted_pages == 16
    assert stats.demoted_pages >= 16 and stats.host_total_pages == 127


def test_stats_and_metrics_report_the_host_tier() -> None:
    _, _, engine = _serve(host_pages=128)
    wire = worker_stats(engine, "w")  # type: ignore[arg-type]
    stats = engine.stats()  # type: ignore[attr-defined]
    assert (wire.host_total_pages, wire.host_cached_pages) == (127, stats.host_cached_pages)
    assert (wire.demoted_pages, wire.promoted_pages) == (stats.demoted_pages, 16)
    assert wire.host_hit_tokens == 64
    snapshot = engine.cache.tree.snapshot()  # type: ignore[attr-defined]
    assert snapshot.host_block_hashes and snapshot.host_block_hashes <= snapshot.block_hashes
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, "w"))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'radixmesh_worker_promoted_pages_total{worker="w"} 16.0' in text
    assert 'radixmesh_worker_host_hit_tokens_total{worker="w"} 64.0' in text
    assert f'radixmesh_worker_host_pages{{worker="w"}} {127:.1f}' in text


@given(st.lists(st.integers(0, 40), max_size=60))
def test_page_runs_cover_the_pages_in_order_as_runs_of_consecutive_ids(pages: list[int]) -> None:
    """What a promotion copies to the GPU run by run (worker/kv_copies.py)."""
    runs = page_runs(array("i", pages))
    rebuilt = [page for _, start, count in runs for page in range(start, start + count)]
    assert rebuilt == pages
    assert [at for at, _, _ in runs] == [sum(c for _, _, c in runs[:i]) for i in range(len(runs))]
    for (_, start, count), (_, following, _) in itertools.pairwise(runs):
        assert start + count != following, "two runs that could have been one"
