"""TierCosts: the marginal cost of a recomputed position is the slope of a line through the
passes (not their ratio, which carries the overhead), a read's the ratio over the reads; reads
are made until both are known, skipped while recomputing is cheaper but for a probe now and
then, and bad observations are ignored."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.tier_costs import TierCosts, TierCostsConfig


def test_the_recompute_cost_is_the_slope_of_the_passes_not_their_ratio() -> None:
    costs = TierCosts()
    for tokens in (1, 2, 3, 64, 128, 256, 512, 1, 3, 300):
        costs.observe_pass(tokens, 0.050 + 0.002 * tokens)  # 50 ms of overhead a pass
    assert costs.recompute_s == pytest.approx(0.002)


def test_passes_that_barely_differ_fall_back_to_their_ratio() -> None:
    costs = TierCosts()
    for _ in range(10):
        costs.observe_pass(4, 0.040)  # a worker that only decodes four sequences
    assert costs.recompute_s == pytest.approx(0.010)


def test_nothing_is_priced_before_enough_passes_and_a_read() -> None:
    costs = TierCosts(TierCostsConfig(min_passes=3, warmup_passes=0))
    costs.observe_read(100, 100.0)  # a very slow disk, but recomputing is not known yet
    assert costs.read_pays(100)
    costs.observe_pass(10, 0.01)
    costs.observe_pass(20, 0.02)
    assert costs.recompute_s is None and costs.read_pays(100)
    costs.observe_pass(30, 0.03)
    assert costs.recompute_s == pytest.approx(0.001)
    assert not costs.read_pays(100) and costs.skipped_positions == 100
    fresh = TierCosts(TierCostsConfig(min_passes=1, warmup_passes=0))
    fresh.observe_pass(10, 1.0)
    assert fresh.read_s is None and fresh.read_pays(5), "the first read teaches its rate"


def test_a_cheaper_recompute_still_probes_the_disk_now_and_then() -> None:
    costs = TierCosts(TierCostsConfig(min_passes=1, probe_every=4, warmup_passes=0))
    costs.observe_pass(10, 0.01)
    costs.observe_read(10, 1.0)
    decisions = [costs.read_pays(8) for _ in range(12)]
    assert decisions == [False, False, False, True] * 3
    assert costs.skipped_positions == 9 * 8
    never = TierCosts(TierCostsConfig(min_passes=1, probe_every=0, warmup_passes=0))
    never.observe_pass(10, 0.01)
    never.observe_read(10, 1.0)
    assert not any(never.read_pays(8) for _ in range(40))


def test_a_workers_first_passes_are_left_out() -> None:
    costs = TierCosts(TierCostsConfig(min_passes=2, warmup_passes=2))
    costs.observe_pass(512, 2.0)  # lazy set-up, a first allocation: one-time costs
    costs.observe_pass(64, 0.5)
    assert costs.recompute_s is None
    costs.observe_pass(100, 0.1)
    costs.observe_pass(300, 0.3)
    assert costs.recompute_s == pytest.approx(0.001)


def test_the_passes_a_recompute_adds_are_priced_with_their_overhead() -> None:
    costs = TierCosts(TierCostsConfig(min_passes=4, warmup_passes=0))
    for tokens in (64, 128, 256, 512):
        costs.observe_pass(tokens, 0.008 + 0.000004 * tokens)  # 8 ms a pass + 4 us a token
    seconds = costs.recompute_seconds(1024, 24, 512)
    assert seconds == pytest.approx(1024 * 0.000004 + 2 * 0.008), "two more passes of 512"
    assert costs.recompute_seconds(100, 24, 512) == pytest.approx(100 * 0.000004)
    costs.observe_read(1024, 0.010)  # a 10 ms read of 1,024 positions beats 20 ms of passes
    assert costs.read_pays(1024, 24, 512)
    assert not costs.read_pays(1024, 24, 1 << 30), "in one pass recomputing is 4 ms"


def test_recent_observations_outweigh_old_ones() -> None:
    costs = TierCosts(TierCostsConfig(half_life=4, min_passes=1))
    for _ in range(50):
        costs.observe_read(10, 1.0)  # 0.1 s a position, long ago
    for _ in range(40):
        costs.observe_read(10, 0.01)  # then the files came into the page cache
    assert costs.read_s is not None and 0.001 < costs.read_s < 0.002  # a plain mean: 0.056


@given(
    st.lists(
        st.tuples(
            st.integers(-3, 2000),
            st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 10)),
        ),
        max_size=40,
    )
)
def test_bad_observations_never_reach_the_rates(observations: list[tuple[int, float]]) -> None:
    costs = TierCosts(TierCostsConfig(min_passes=1))
    for tokens, seconds in observations:
        costs.observe_pass(tokens, seconds)
        costs.observe_read(tokens, seconds)
    for rate in (costs.recompute_s, costs.read_s):
        assert rate is None or (math.isfinite(rate) and rate >= 0)
    assert isinstance(costs.read_pays(16), bool)


@pytest.mark.parametrize(
    "fields",
    [
        {"half_life": 0},
        {"min_passes": 0},
        {"probe_every": -1},
        {"warmup_passes": -1},
        {"min_spread_tokens": math.nan},
    ],
)
def test_a_bad_config_is_refused_by_name(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        TierCostsConfig(**fields)  # type: ignore[arg-type]


def test_a_read_is_priced_by_the_files_it_reads_whole() -> None:
    costs = TierCosts(TierCostsConfig(min_passes=1, warmup_passes=0))
    costs.observe_pass(10, 0.010)  # 1 ms a position
    costs.observe_read(100, 0.050)  # 0.5 ms a position of file
    assert costs.read_pays(8, files=8), "8 positions read for 8 used: 4 ms against 8 ms"
    assert not costs.read_pays(8, files=40), "a 40-position file for 8 of them: 20 ms"
