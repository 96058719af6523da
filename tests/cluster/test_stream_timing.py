"""The router's stopwatch: the timings of forwarded streams teach a real policy real speeds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.stream_timing import StreamTiming
from router.config import RouterConfig
from router.policies import make_policy
from router.service_model import ServiceRates
from tests.router.helpers import Clock


def test_learned_rates_reach_the_policy_and_queued_requests_are_not_samples() -> None:
    clock = Clock()
    policy = make_policy("cache_aware", clock=clock)
    timing = StreamTiming(lambda: policy, 8000.0, every=4, clock=clock)
    prefill_rate, decode_s = 50_000.0, 0.003
    for i in range(40):
        clock.now = i * 10.0
        dispatch = timing.dispatched("w0", 1000)
        clock.now += decode_s + 500 / prefill_rate  # alone: one step + 500 uncached tokens
        timing.responded(dispatch, 0, 1, cached_prompt_tokens=500)
        for _ in range(5):
            clock.now += decode_s
            timing.responded(dispatch, 0, 1, cached_prompt_tokens=500)
        timing.ended(dispatch)
    assert policy.prefill_rate == pytest.approx(prefill_rate, rel=1e-6)
    assert policy.decode_s == pytest.approx(decode_s, rel=1e-6)

    # a request dispatched behind another's prefill waited: its first token is no sample
    before = timing.model.rates()
    first = timing.dispatched("w0", 1000)
    second = timing.dispatched("w0", 1000)
    clock.now += 5.0
    timing.responded(second, 0, 1, cached_prompt_tokens=0)
    assert timing.model.rates() == before
    timing.responded(first, 0, 1, cached_prompt_tokens=0)
    timing.ended(first)
    timing.ended(second)
    assert timing.model.rates() != ServiceRates(prefill_rate, decode_s)  # `first` was one


def test_interleaved_samples_are_not_taken_for_engine_steps() -> None:
    """With n = 2 each engine step streams one message per sample, back to back: only the gaps
    between one sample's messages are steps (the gap to the sibling's message is not)."""
    clock = Clock()
    policy = make_policy("cache_aware", clock=clock)
    timing = StreamTiming(lambda: policy, 8000.0, every=4, clock=clock)
    decode_s = 0.004
    for i in range(40):
        clock.now = i * 10.0
        dispatch = timing.dispatched("w0", 600)
        for _ in range(6):
            clock.now += decode_s
            for index in (0, 1):
                timing.responded(dispatch, index, 1, cached_prompt_tokens=0)
                clock.now += 1e-6  # the sibling's message follows at once
            clock.now -= 2e-6
        timing.ended(dispatch)
    assert policy.decode_s == pytest.approx(decode_s, rel=1e-6)


def test_a_policy_switched_in_is_calibrated_at_the_next_observation() -> None:
    clock = Clock()
    policies = [make_policy("cache_aware", clock=clock)]
    timing = StreamTiming(lambda: policies[-1], 8000.0, every=1000, clock=clock)
    decode_s = 0.002
    dispatch = timing.dispatched("w0", 100)
    timing.responded(dispatch, 0, 1, cached_prompt_tokens=0)
    for _ in range(40):
        clock.now += decode_s
        timing.responded(dispatch, 0, 1, cached_prompt_tokens=0)
    policies.append(make_policy("cache_aware", clock=clock))  # what Admin.SetPolicy does
    assert policies[-1].decode_s == 0.0
    clock.now += decode_s
    timing.responded(dispatch, 0, 1, cached_prompt_tokens=0)
    timing.ended(dispatch)
    assert policies[-1].decode_s == pytest.approx(decode_s, rel=1e-6)


def test_first_tokens_with_reads_from_peers_teach_the_read_rate_not_the_prefill_rate() -> None:
    clock = Clock()
    policy = make_policy("cache_aware", replace(RouterConfig(), peer_rate=20_000.0), clock)
    timing = StreamTiming(lambda: policy, 8000.0, every=1, clock=clock, peer_rate=20_000.0)
    prefill_rate, read_rate = 50_000.0, 100_000.0
    for i in range(40):  # first tokens without reads: 100-1,000 uncached tokens
        clock.now = i * 10.0
        dispatch = timing.dispatched("w0", 2000)
        uncached = 100 * (1 + i % 10)
        clock.now += uncached / prefill_rate
        timing.responded(dispatch, 0, 1, cached_prompt_tokens=2000 - uncached)
        timing.ended(dispatch)
    for i in range(40):  # 1,500 tokens read from a peer, 100 computed
        clock.now = 1000.0 + i * 10.0
        dispatch = timing.dispatched("w0", 2000)
        clock.now += 100 / prefill_rate + 1500 / read_rate
        timing.responded(dispatch, 0, 1, cached_prompt_tokens=1900, peer_cached_tokens=1500)
        timing.ended(dispatch)
    assert policy.prefill_rate == pytest.approx(prefill_rate, rel=1e-3)
    assert policy.peer_rate == pytest.approx(read_rate, rel=1e-3)
