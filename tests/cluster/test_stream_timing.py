"""The router's stopwatch: the timings of forwarded streams teach a real policy real speeds."""

from __future__ import annotations

import pytest

from cluster.stream_timing import StreamTiming
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
        timing.responded(dispatch, 1, cached_prompt_tokens=500)
        for _ in range(5):
            clock.now += decode_s
            timing.responded(dispatch, 1, cached_prompt_tokens=500)
        timing.ended(dispatch)
    assert policy.prefill_rate == pytest.approx(prefill_rate, rel=1e-6)
    assert policy.decode_s == pytest.approx(decode_s, rel=1e-6)

    # a request dispatched behind another's prefill waited: its first token is no sample
    before = timing.model.rates()
    first = timing.dispatched("w0", 1000)
    second = timing.dispatched("w0", 1000)
    clock.now += 5.0
    timing.responded(second, 1, cached_prompt_tokens=0)
    assert timing.model.rates() == before
    timing.responded(first, 1, cached_prompt_tokens=0)
    timing.ended(first)
    timing.ended(second)
    assert timing.model.rates() != ServiceRates(prefill_rate, decode_s)  # `first` was one
