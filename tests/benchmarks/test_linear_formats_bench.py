"""The linear-formats benchmark's code path on small matrices (no timings asserted): every
candidate computes the product it claims, within its format's error, and the copies that keep
weights out of the caches add up to what was asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import linear_formats_bench as bench
from tests.worker.helpers import relative_error

BOUND = {"float32": 1e-6, "bf16": 0.01, "int8": 0.02, "int4": 0.15}
"""Relative error of each candidate's product against float32, by the format it reads."""


def test_every_candidate_computes_the_product() -> None:
    out, inp = 96, 128
    found = bench.candidates(out, inp, seed=3)
    assert len(found) == 12
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(3)) / inp**0.5
    x = torch.randn(4, inp)
    want = F.linear(x, w)
    for name, (operands, fn) in found.items():
        got = fn(x, *operands)
        assert got.shape == (4, out) and got.dtype == torch.float32, name
        assert relative_error(got, want) < BOUND[name.split()[0]], name


def test_copies_add_up_to_the_cold_bytes() -> None:
    operands = (torch.zeros(1000, dtype=torch.uint8), torch.zeros(250, dtype=torch.float32))
    sets = bench.copies(operands, 10_000)
    assert len(sets) == 5 and sets[0] is operands
    pointers = {t.data_ptr() for each in sets for t in each}
    assert len(pointers) == 10, "each copy has storage of its own"


def test_measure_reports_every_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "SHAPES", {"small 64x64": (64, 64)})
    results = bench.measure(rounds=1, budget_s=0.0, cold_bytes=1 << 16)
    assert set(results) == {"small 64x64 x 1", "small 64x64 x 256"}
    for row in results.values():
        assert len(row) == 12 and all(ms > 0 for ms in row.values())
