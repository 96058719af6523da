"""The priority scheduling policy (worker/scheduler.py): waiting requests are admitted by
priority, lower first; a request that has no room preempts running ones of a strictly lower
priority; a page shortage preempts the lowest-priority running sample. Scheduling never changes
what a request generates."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA, Recorder, drain, greedy
from tests.worker.test_disk_reads import (
    PROMPT,
    SAVED,
    cold_answer,
    drained,
    gate_reads,
    reading,
    saved_and_cleared,
)
from tests.worker.test_kv_persistence import TURNS
from worker.engine import Engine, EngineConfig
from worker.errors import EngineOverloaded, InvalidRequest
from worker.request import GenerateRequest, RequestOutput
from worker.samples import Phase, SampleState
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

MODEL = tiny_model(LLAMA, seed=11)


def _engine(policy: str, **config: int) -> tuple[Engine, Recorder]:
    settings = {"num_pages": 64, "page_size": 4, "max_running": 1, "max_waiting": 64}
    engine = Engine(MODEL, None, EngineConfig(**(settings | config), scheduling_policy=policy))
    return engine, Recorder()


def _request(
    request_id: str, priority: int, prompt: Sequence[int], max_tokens: int = 6, n: int = 1
) -> GenerateRequest:
    temperature = 0.0 if n == 1 else 0.9
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7, n=n)
    return GenerateRequest(request_id, tuple(prompt), sampling=sampling, priority=priority)


def _first_token_order(recorder: Recorder) -> list[str]:
    order: list[str] = []
    for output in recorder.outputs:
        if output.token_ids and output.request_id not in order:
            order.append(output.request_id)
    return order


PRIORITIES = {"a": 0, "b": 5, "c": -1, "d": 5, "e": -1}


def _prompt(request_id: str) -> list[int]:
    start = 10 + 20 * sorted(PRIORITIES).index(request_id)
    return list(range(start, start + 9))


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("priority", ["c", "e", "a", "b", "d"]), ("fcfs", ["a", "b", "c", "d", "e"])],
)
def test_waiting_requests_start_by_priority_and_in_arrival_order_within_one(
    policy: str, expected: list[str]
) -> None:
    engine, recorder = _engine(policy)
    for request_id, priority in PRIORITIES.items():
        asked = priority if policy == "priority" else 0
        engine.submit(_request(request_id, asked, _prompt(request_id)), recorder.outputs.append)
    drain(engine)
    assert _first_token_order(recorder) == expected
    assert engine.stats().preemptions == 0  # nothing ran before the queue was ordered
    check_sequence_cache(engine.cache)


def test_a_higher_priority_request_preempts_a_lower_one_and_both_generate_as_alone() -> None:
    alone, alone_out = _engine("priority")
    for request_id in ("low", "high"):
        alone.submit(
            _request(request_id, 0, _prompt("a" if request_id == "low" else "b"), 12),
            alone_out.outputs.append,
        )
    drain(alone)
    engine, recorder = _engine("priority")
    engine.submit(_request("low", 3, _prompt("a"), 12), recorder.outputs.append)
    for _ in range(4):  # the low one prefills and draws a token in a step, then decodes
        engine.step()
    assert len(recorder.tokens("low")) == 4
    engine.submit(_request("high", -2, _prompt("b"), 12), recorder.outputs.append)
    engine.step()  # no running slot left: the low one is preempted for it
    assert engine.stats().preemptions == 1
    assert [s.request.request_id for s in engine.scheduler.running] == ["high"]
    (waiting,) = engine.scheduler.waiting
    assert waiting.request.request_id == "low" and waiting.phase is Phase.WAITING
    drain(engine)
    high_done = next(
        i for i, o in enumerate(recorder.outputs) if o.request_id == "high" and o.finished
    )
    low_after = [o for o in recorder.outputs[high_done:] if o.request_id == "low" and o.token_ids]
    assert len(low_after) == 12 - 4  # the low one resumed only once the high one had finished
    for request_id in ("low", "high"):
        assert recorder.tokens(request_id) == alone_out.tokens(request_id)
    # its computed KV stayed cached through the preemption: it came back from the cache
    assert engine.cache.stats.reused_positions >= len(_prompt("a"))
    check_sequence_cache(engine.cache)


def test_requests_of_equal_priority_never_preempt_each_other_to_start() -> None:
    engine, recorder = _engine("priority")
    engine.submit(_request("first", 1, _prompt("a"), 10), recorder.outputs.append)
    engine.step()
    engine.submit(_request("second", 1, _prompt("b"), 10), recorder.outputs.append)
    drain(engine)
    assert engine.stats().preemptions == 0
    first_done = next(i for i, o in enumerate(recorder.outputs) if o.finished)
    assert recorder.outputs[first_done].request_id == "first"
    assert all(o.request_id == "first" for o in recorder.outputs[:first_done])


def _until_preempted(engine: Engine) -> None:
    for _ in range(200):
        if engine.scheduler.preemptions:
            return
        assert engine.step()
    raise AssertionError("no preemption: the pool is not tight enough")


@pytest.mark.parametrize(("policy", "preempted"), [("priority", "older"), ("fcfs", "younger")])
def test_a_page_shortage_preempts_the_lowest_priority_not_the_youngest(
    policy: str, preempted: str
) -> None:
    # 14 pages of 4: both 20-token prompts fit, not both of their 20-token growths
    engine, recorder = _engine(policy, num_pages=14, max_running=2)
    low = 4 if policy == "priority" else 0
    engine.submit(_request("older", low, list(range(3, 23)), 20), recorder.outputs.append)
    engine.submit(_request("younger", 0, list(range(40, 60)), 20), recorder.outputs.append)
    _until_preempted(engine)
    assert [s.request.request_id for s in engine.scheduler.waiting] == [preempted]
    drain(engine)
    check_sequence_cache(engine.cache)


def test_a_priority_is_refused_under_fcfs_by_name() -> None:
    engine, recorder = _engine("fcfs")
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(_request("r", -1, _prompt("a")), recorder.outputs.append)
    assert refused.value.field == "priority"
    assert "scheduling_policy" in str(refused.value)
    engine.submit(_request("zero", 0, _prompt("a")), recorder.outputs.append)  # 0 asks nothing
    drain(engine)
    assert recorder.final("zero").finish_reason == "length"


def test_an_unknown_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"fcfs, priority.*'lifo'"):
        Engine(MODEL, None, EngineConfig(num_pages=16, page_size=4, scheduling_policy="lifo"))


# -- a property: random traffic -----------------------------------------------------------------
def _spy_on_plans(engine: Engine, check: Callable[[list[SampleState]], None]) -> None:
    """Run `check` on every step's plan, right after the real scheduler made it."""
    schedule = engine.scheduler.schedule

    def spied(*args: object, **kwargs: object) -> list[tuple[SampleState, int]]:
        plan = schedule(*args, **kwargs)  # type: ignore[arg-type]
        check([sample for sample, _ in plan])
        return plan

    engine.scheduler.schedule = spied  # type: ignore[method-assign]


SEEN = {"preemptions": 0, "runs": 0}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    requests=st.integers(4, 24),
    num_pages=st.integers(14, 40),
    max_running=st.integers(1, 4),
)
def _random_traffic(seed: int, requests: int, num_pages: int, max_running: int) -> None:
    """Requests of random priorities, lengths, n and arrival times, with aborts, on a pool
    tight enough to preempt. After every step: no sample computed in it has a lower priority
    (higher value) than one left waiting, both queues are in key order, and every page is
    accounted for. At the end: every sample finished once, and each request not aborted
    generated exactly what it generates alone on a roomy FCFS engine."""
    rng = random.Random(seed)
    engine, recorder = _engine("priority", num_pages=num_pages, max_running=max_running)
    shared = [rng.randrange(1, 384) for _ in range(8)]

    def check(planned: list[SampleState]) -> None:
        scheduler = engine.scheduler
        waiting = [s.request.request.priority for s in scheduler.waiting]
        if planned and waiting:
            assert max(s.request.request.priority for s in planned) <= min(waiting)
        for queue in (scheduler.waiting, scheduler.running):
            keys = [(s.request.request.priority, s.request.queue_order, s.index) for s in queue]
            assert keys == sorted(keys)

    _spy_on_plans(engine, check)
    made: list[GenerateRequest] = []
    aborted: set[str] = set()
    for i in range(requests):
        head = shared if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(1, 384) for _ in range(rng.randint(2, 12))]
        request = _request(
            f"r{i}", rng.randint(-2, 2), prompt, rng.randint(1, 12), rng.choice([1, 1, 2])
        )
        made.append(request)
        engine.submit(request, recorder.outputs.append)
        for _ in range(rng.randint(0, 3)):
            engine.step()
            check_sequence_cache(engine.cache)
        if rng.random() < 0.1:
            victim = rng.choice(made).request_id
            aborted.add(victim)
            engine.abort(victim)
    drain(engine)
    check_sequence_cache(engine.cache)
    pool = engine.cache.pool
    assert pool.num_private == 0
    assert pool.num_free + engine.cache.tree.cached_pages == pool.usable_pages
    finals = [(o.request_id, o.index) for o in recorder.outputs if o.finished]
    assert sorted(finals) == sorted((r.request_id, k) for r in made for k in range(r.sampling.n))
    reference, expected = _engine("fcfs", num_pages=256, max_running=8)
    for request in made:
        if request.request_id not in aborted:
            reference.submit(_request_at_zero(request), expected.outputs.append)
    drain(reference)
    for request in made:
        if request.request_id in aborted:
            continue
        for k in range(request.sampling.n):
            assert recorder.tokens(request.request_id, k) == expected.tokens(request.request_id, k)
    SEEN["preemptions"] += engine.stats().preemptions
    SEEN["runs"] += 1


def _request_at_zero(request: GenerateRequest) -> GenerateRequest:
    assert request.prompt_token_ids is not None
    return GenerateRequest(
        request.request_id, request.prompt_token_ids, sampling=request.sampling, priority=0
    )


def test_random_traffic_keeps_priority_order_pages_and_outputs() -> None:
    SEEN.update(dict.fromkeys(SEEN, 0))
    _random_traffic()
    # preemption happens in most runs, not in every one (the tests above make it on purpose)
    assert SEEN["runs"] >= 40 and SEEN["preemptions"] > 0, SEEN


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_nothing_passes_a_request_that_waits_for_room(policy: str) -> None:
    """Within a priority, as under FCFS: a small request behind one too large for the pages
    left waits its turn, even though it would fit."""
    engine, recorder = _engine(policy, num_pages=14, max_running=3)  # 13 pages of 4
    engine.submit(_request("running", 0, list(range(3, 23)), 16), recorder.outputs.append)
    engine.step()
    engine.submit(_request("large", 0, list(range(40, 76)), 4), recorder.outputs.append)
    engine.submit(_request("small", 0, [90, 91, 92], 4), recorder.outputs.append)
    engine.step()
    assert [s.request.request_id for s in engine.scheduler.running] == ["running"]
    assert [s.request.request_id for s in engine.scheduler.waiting] == ["large", "small"]
    drain(engine)
    assert _first_token_order(recorder) == ["running", "large", "small"]
    check_sequence_cache(engine.cache)


def test_a_high_priority_request_reading_from_disk_preempts_no_more_than_to_begin_its_read(
    tmp_path: Path,
) -> None:
    """Its read needs a running slot's worth of room to begin (one preemption); while the read
    is in flight it waits, and the low one it displaced runs again: preempting it each step
    would bring the read no sooner."""
    engine = saved_and_cleared(tmp_path, scheduling_policy="priority", max_running=1)
    assert engine.store is not None
    gate, _ = gate_reads(engine.store)
    decoding: list[int] = []
    low = replace(greedy("low", TURNS[2][::-1], 24), priority=1)
    engine.submit(low, lambda o: decoding.extend(o.token_ids))
    engine.step()
    outputs: list[RequestOutput] = []
    engine.submit(greedy("hit", PROMPT, 6), outputs.append)
    before = len(decoding)
    for _ in range(8):
        assert engine.step()
    assert reading(engine), "the high one waits for its read"
    assert engine.stats().preemptions <= 1
    assert len(decoding) - before >= 6, "the low one decoded while the read was held"
    gate.set()
    final, tokens = drained(engine, outputs)
    assert final.cached_prompt_tokens == SAVED and len(decoding) == 24
    assert tokens == cold_answer(PROMPT)[0]
    check_sequence_cache(engine.cache)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_full_engine_turns_away_only_what_is_no_more_urgent_than_what_fills_it(
    policy: str,
) -> None:
    engine, recorder = _engine(policy, max_running=1, max_waiting=1)  # 2 requests at most
    low = 3 if policy == "priority" else 0
    for k in range(2):
        engine.submit(_request(f"low{k}", low, _prompt("a")), recorder.outputs.append)
    with pytest.raises(EngineOverloaded, match="2 requests in flight"):
        engine.submit(_request("low2", low, _prompt("b")), recorder.outputs.append)
    if policy == "priority":  # the low ones do not count against a more urgent request
        for k in range(2):
            engine.submit(_request(f"high{k}", 0, _prompt("c")), recorder.outputs.append)
        with pytest.raises(EngineOverloaded, match="2 requests in flight at priority 0 or more"):
            engine.submit(_request("high2", 0, _prompt("d")), recorder.outputs.append)
        # all together stay within twice the limit, however urgent a request says it is
        with pytest.raises(EngineOverloaded, match="4 requests in flight of every priority"):
            engine.submit(_request("urgent", -9, _prompt("d")), recorder.outputs.append)
    drain(engine)
    ended = sorted(o.request_id for o in recorder.outputs if o.finished)
    assert ended == (
        ["high0", "high1", "low0", "low1"] if policy == "priority" else ["low0", "low1"]
    )
    engine.submit(_request("later", low, _prompt("b")), recorder.outputs.append)  # room again
    drain(engine)
    check_sequence_cache(engine.cache)
