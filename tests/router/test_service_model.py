"""The learned service model: it recovers the speeds that produced its observations, stands on
the configured rate until it has seen enough, and never learns a negative or absurd value."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.service_model import ServiceModel

rates = st.floats(min_value=500.0, max_value=200_000.0)
decodes = st.floats(min_value=1e-4, max_value=0.02)


@given(
    rate=rates,
    decode_s=decodes,
    samples=st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 12)), min_size=16, max_size=80),
)
def test_recovers_the_rates_behind_noiseless_observations(
    rate: float, decode_s: float, samples: list[tuple[int, int]]
) -> None:
    model = ServiceModel(8000.0)
    for _, running in samples:
        model.observe_step(running + 1, decode_s * (running + 1))
    assert model.decode_s == pytest.approx(decode_s, rel=1e-6)
    for uncached, running in samples:
        model.observe_first_token(uncached, running, decode_s * (running + 1) + uncached / rate)
    expected = min(max(rate, 8000.0 / 100), 8000.0 * 100)
    assert model.prefill_rate == pytest.approx(expected, rel=1e-6)


def test_the_configured_rate_stands_until_enough_was_seen() -> None:
    model = ServiceModel(8000.0, min_samples=16)
    for _ in range(15):
        model.observe_step(2, 0.004)
        model.observe_first_token(100, 0, 0.001)
    assert (model.prefill_rate, model.decode_s) == (8000.0, 0.0)
    model.observe_step(2, 0.004)
    assert model.decode_s == pytest.approx(0.002)


def test_recent_behaviour_wins() -> None:
    model = ServiceModel(8000.0, half_life=16)
    for _ in range(200):
        model.observe_step(1, 0.010)
    for _ in range(200):
        model.observe_step(1, 0.002)
    assert model.decode_s == pytest.approx(0.002, rel=0.01)


@given(
    st.lists(
        st.tuples(st.integers(-5, 5000), st.integers(-2, 20), st.floats(-1.0, 10.0)),
        max_size=60,
    )
)
def test_never_negative_and_never_beyond_the_clamp(
    observations: list[tuple[int, int, float]],
) -> None:
    model = ServiceModel(8000.0, min_samples=1, max_factor=10.0)
    for tokens, running, seconds in observations:
        model.observe_step(running, seconds)
        model.observe_first_token(tokens, running, seconds)
        assert model.decode_s >= 0.0
        assert 800.0 <= model.prefill_rate <= 80_000.0


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefill_rate"):
        ServiceModel(0.0)


@given(
    rate=rates,
    decode_s=decodes,
    overhead_s=st.floats(min_value=0.0, max_value=0.01),
    samples=st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 12)), min_size=16),
)
def test_a_fixed_overhead_per_request_is_kept_out_of_the_rate(
    rate: float, decode_s: float, overhead_s: float, samples: list[tuple[int, int]]
) -> None:
    """Hops and scheduling cost the same on every worker: with uncached lengths that spread,
    the rate is the slope, not the ratio (which would charge the overhead to the tokens)."""
    model = ServiceModel(8000.0, min_spread_tokens=32.0)
    for _, running in samples:
        model.observe_step(running + 1, decode_s * (running + 1))
    for uncached, running in samples:
        seconds = overhead_s + decode_s * (running + 1) + uncached / rate
        model.observe_first_token(uncached, running, seconds)
    xs = [uncached for uncached, _ in samples]
    spread = (sum(x * x for x in xs) / len(xs) - (sum(xs) / len(xs)) ** 2) ** 0.5
    if spread >= 40.0:  # clear of the threshold and of rounding in the decayed sums
        expected = min(max(rate, 80.0), 800_000.0)
        assert model.prefill_rate == pytest.approx(expected, rel=1e-3)
    elif spread < 24.0 and overhead_s > 1e-4:
        assert model.prefill_rate < rate  # the ratio: the overhead is charged to the tokens


def test_non_finite_observations_are_ignored() -> None:
    """One infinite duration would stay in the decayed sums for good, and an infinite decode
    cost makes every score inf or NaN (inf x 0 running) once calibrated."""
    model = ServiceModel(8000.0, min_samples=1)
    for seconds in (float("inf"), float("nan"), -1.0):
        model.observe_step(2, seconds)
        model.observe_first_token(100, 0, seconds)
    assert (model.prefill_rate, model.decode_s) == (8000.0, 0.0)
    model.observe_step(2, 0.004)
    assert model.decode_s == pytest.approx(0.002)


@pytest.mark.parametrize(
    ("prefill_rate", "decode_s"),
    [(0.0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (float("inf"), 0.0), (8000.0, -0.1),
     (8000.0, float("inf")), (8000.0, float("nan"))],
)  # fmt: skip
def test_rates_that_would_break_a_score_are_refused_before_calibrate(
    prefill_rate: float, decode_s: float
) -> None:
    from router.service_model import ServiceRates

    with pytest.raises(ValueError, match="prefill_rate"):
        ServiceRates(prefill_rate, decode_s)
