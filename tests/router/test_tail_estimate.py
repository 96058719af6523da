"""TailEstimate: the running quantile behind burst order and the work term's cut-off. It must
equal the exact order statistic of the samples it keeps: the last `window`, every `stride`-th."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.burst import TailEstimate


@given(
    samples=st.lists(st.floats(min_value=0.0, max_value=1e4), max_size=300),
    window=st.integers(1, 64),
    stride=st.integers(1, 5),
    quantile=st.floats(min_value=0.01, max_value=0.99),
)
def test_value_is_the_exact_quantile_of_the_kept_samples(
    samples: list[float], window: int, stride: int, quantile: float
) -> None:
    tail = TailEstimate(quantile, fallback_s=-1.0, window=window, warmup=1, stride=stride)
    for i, sample in enumerate(samples):
        tail.add(sample)
        kept = sorted(samples[: i + 1 : stride][-window:])
        assert tail.value == kept[min(len(kept) - 1, int(quantile * len(kept)))]
    if not samples:
        assert tail.value == -1.0


def test_the_fallback_stands_until_warmup_samples_were_kept() -> None:
    tail = TailEstimate(0.5, fallback_s=5.0, window=16, warmup=4, stride=2)
    for sample in (1.0, 9.0, 2.0, 9.0, 3.0, 9.0):  # keeps 1, 2, 3
        tail.add(sample)
    assert tail.value == 5.0
    tail.add(4.0)
    assert tail.value == 3.0  # the median of 1, 2, 3, 4 at index int(0.5 x 4)


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="quantile"):
        TailEstimate(1.0)
    with pytest.raises(ValueError, match="stride"):
        TailEstimate(0.5, stride=0)
    with pytest.raises(ValueError, match="warmup 0"):
        TailEstimate(0.5, warmup=0)  # `value` would index an empty array
    with pytest.raises(ValueError, match="warmup 65, window 64"):
        TailEstimate(0.5, window=64, warmup=65)  # the fallback would stand for good
