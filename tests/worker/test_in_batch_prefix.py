"""Requests sent together with a shared prefix compute it once (worker/scheduler.py,
`Scheduler._shares_a_prefill`): the ones behind the first wait for its prompt to be cached and
read the prefix from there. What each request generates does not change, nothing cached is
held back for, and every page is accounted for."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cache import CacheNamespace
from cache.integrity import check_sequence_cache
from tests.worker.helpers import Recorder, drain, greedy
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel
from worker.request import GenerateRequest, PoolingParams

CONFIG = EngineConfig(
    num_pages=256, page_size=4, max_running=8, token_budget=1024, max_prefill_chunk=256,
    max_model_len=256,
)  # fmt: skip
PREFIX = tuple(5 + i % 97 for i in range(60))


def computed(engine: Engine, requests: list[GenerateRequest]) -> tuple[int, dict[str, list[int]]]:
    """The prompt tokens the engine computed (not read from its cache) for `requests`, sent
    together, and each request's tokens."""
    recorder = Recorder()
    for request in requests:
        engine.submit(request, recorder.outputs.append)
    drain(engine)
    check_sequence_cache(engine.cache)
    firsts = [outs[0] for outs in recorder.by_request().values()]
    tokens = {r.request_id: recorder.tokens(r.request_id) for r in requests}
    return sum(o.prompt_tokens - o.cached_prompt_tokens for o in firsts), tokens


def off(engine: Engine) -> Engine:
    engine.scheduler.config = replace(engine.scheduler.config, in_batch_shared=0)
    return engine


def test_requests_sent_together_compute_their_shared_prefix_once(tiny: LoadedModel) -> None:
    requests = [greedy(f"r{i}", (*PREFIX, 200 + i, 3, 4, 5, 6), 5) for i in range(6)]
    once, tokens = computed(Engine(tiny.model, tiny.tokenizer, CONFIG), requests)
    each, baseline = computed(off(Engine(tiny.model, tiny.tokenizer, CONFIG)), requests)
    assert once == 65 + 5 * 5  # the first whole; the others past the prefix's 15 pages
    assert each == 6 * 65  # admitted in one step, every one computes the prefix
    assert tokens == baseline
    alone = {}
    for request in requests:  # and what each generates alone, on a cold engine
        _, mine = computed(Engine(tiny.model, tiny.tokenizer, CONFIG), [request])
        alone |= mine
    assert tokens == alone


def test_embedding_requests_sent_together_share_their_instruction(tiny: LoadedModel) -> None:
    requests = [
        GenerateRequest(f"e{i}", prompt_token_ids=(*PREFIX, 150 + i), pooling=PoolingParams())
        for i in range(8)
    ]
    once, _ = computed(Engine(tiny.model, tiny.tokenizer, CONFIG), requests)
    assert once == 61 + 7 * 1


def test_a_prefix_already_cached_holds_no_one_back(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    computed(engine, [greedy("warm", (*PREFIX, 9), 1)])
    for i in range(4):  # they share only the cached prefix
        engine.submit(
            greedy(f"r{i}", (*PREFIX, *range(100 + 40 * i, 140 + 40 * i)), 3), lambda _: None
        )
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (4, 0)
    unrelated = Engine(tiny.model, tiny.tokenizer, CONFIG)
    for i in range(4):
        unrelated.submit(greedy(f"u{i}", range(10 + i, 80 + i), 3), lambda _: None)
    unrelated.step()
    assert (unrelated.stats().running, unrelated.stats().waiting) == (4, 0)
    drain(engine)
    drain(unrelated)


def test_a_request_behind_waits_only_for_the_prefill(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, replace(CONFIG, max_prefill_chunk=16))
    outputs = Recorder()
    engine.submit(greedy("a", (*PREFIX, 1, 2), 40), outputs.outputs.append)
    engine.submit(greedy("b", (*PREFIX, 7, 8), 40), outputs.outputs.append)
    while not outputs.tokens("a"):  # a's prompt, 16 tokens a step: b waits meanwhile
        engine.step()
        assert (engine.stats().running, engine.stats().waiting) == (1, 1)
    engine.step()  # a's prompt is cached: b is admitted as a decodes
    assert (engine.stats().running, engine.stats().waiting) == (2, 0)
    drain(engine)
    assert outputs.final("b").cached_prompt_tokens == 60
    check_sequence_cache(engine.cache)


def test_the_samples_behind_one_that_waits_keep_their_place(tiny: LoadedModel) -> None:
    """FIFO: an unrelated request behind the one waiting is not admitted before it (it would
    take the running slot the waiting one is to have)."""
    engine = Engine(tiny.model, tiny.tokenizer, replace(CONFIG, max_running=2))
    recorder = Recorder()
    for request in (greedy("o", (*PREFIX, 1), 20), greedy("w", (*PREFIX, 2), 20)):
        engine.submit(request, recorder.outputs.append)
    engine.submit(greedy("u", range(100, 140), 20), recorder.outputs.append)
    first: dict[str, int] = {}
    for step in range(1, 200):
        if not engine.step():
            break
        for request_id in ("o", "w", "u"):
            if recorder.tokens(request_id):
                first.setdefault(request_id, step)
    assert first["o"] == 1 and first["w"] == 2  # w waited one prefill, then read it cached
    assert first["u"] > 20  # a slot frees only when o ends
    assert recorder.final("w").cached_prompt_tokens == 60
    check_sequence_cache(engine.cache)


def test_a_prompt_being_scored_holds_no_one_back(tiny: LoadedModel) -> None:
    """It computes every position, cached or not: its hit says nothing of what is cached, and
    the prefix a request shares with it here is cached already."""
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    computed(engine, [greedy("warm", (*PREFIX, 9), 1)])
    engine.submit(greedy("s", (*PREFIX, *range(100, 140)), 2, prompt_logprobs=1), lambda _: None)
    engine.submit(greedy("w", (*PREFIX, 1, 2), 2), lambda _: None)
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (2, 0)
    drain(engine)
    check_sequence_cache(engine.cache)


@example(  # a review's case: holding w must not cost the x's the hits they would have had
    shapes=[(54, [3] * 12), (60, [4] * 12), (28, [5, 6]), (28, [7, 8])], budget=64
)
@settings(max_examples=20, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(0, 60), st.lists(st.integers(3, 250), min_size=1, max_size=12)),
        min_size=2,
        max_size=7,
    ),
    budget=st.sampled_from([16, 64, 1024]),
)
def test_holding_back_changes_no_output_and_never_computes_more(
    tiny: LoadedModel, shapes: list[tuple[int, list[int]]], budget: int
) -> None:
    prompts = [(*PREFIX[:shared], *tail) for shared, tail in shapes]
    requests = [greedy(f"r{i}", p, 3) for i, p in enumerate(prompts)]
    config = replace(CONFIG, token_budget=budget, max_prefill_chunk=min(budget, 64))
    once, tokens = computed(Engine(tiny.model, tiny.tokenizer, config), requests)
    each, baseline = computed(off(Engine(tiny.model, tiny.tokenizer, config)), requests)
    assert tokens == baseline
    assert once <= each


def test_a_prompt_being_scored_is_never_held_back(tiny: LoadedModel) -> None:
    """It computes every position anyway (its logprobs are wanted at each): waiting would
    save it nothing."""
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    engine.submit(greedy("a", (*PREFIX, 1, 2), 3), lambda _: None)
    engine.submit(greedy("scored", (*PREFIX, 7, 8), 3, prompt_logprobs=1), lambda _: None)
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (2, 0)
    drain(engine)
    check_sequence_cache(engine.cache)


def test_another_tenants_prompt_holds_no_one_back(tiny: LoadedModel) -> None:
    """Its cache is not this one's: waiting would read nothing."""
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    for tenant in ("a", "b", "c"):
        request = replace(greedy(tenant, (*PREFIX, 1), 3), namespace=CacheNamespace(tenant=tenant))
        engine.submit(request, lambda _: None)
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (3, 0)
    drain(engine)
    check_sequence_cache(engine.cache)


def test_the_setting_sets_the_threshold_and_zero_turns_the_wait_off(tiny: LoadedModel) -> None:
    """EngineConfig.in_batch_prefix_tokens (the cluster's engine.in_batch_prefix_tokens)."""
    requests = [greedy(f"r{i}", (*PREFIX, 200 + i), 2) for i in range(3)]
    for tokens in (0, 80):  # none waits; more than the 60 shared: none waits
        config = replace(CONFIG, in_batch_prefix_tokens=tokens)
        engine = Engine(tiny.model, tiny.tokenizer, config)
        assert engine.scheduler.config.in_batch_shared == tokens
        assert computed(engine, requests)[0] == 3 * 61
    assert computed(Engine(tiny.model, tiny.tokenizer, CONFIG), requests)[0] == 61 + 2 * 1
