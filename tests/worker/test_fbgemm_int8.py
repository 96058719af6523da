"""worker/fbgemm_int8.py: the int8 head's sums through fbgemm are `torch._int_mm`'s, bit for bit,
at any row count and width, for the extremes an int16 pair sum would saturate on; a kernel that
does not give them is refused by the probe and the head keeps `_int_mm`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker import fbgemm_int8, quantized_linear
from worker.quantized_linear import QuantizedLinear, int8_dynamic_matmul

pytestmark = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines
    or not quantized_linear.INT8_DYNAMIC_HEAD,
    reason="no fbgemm in this torch build, or a CPU without int8 dot products (AVX-512 VNNI),"
    " where the head is not int8: fbgemm is used only where the int8 head is",
)


def weight(out: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out, width), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out, generator=gen) * 0.01 + 1e-4).to(torch.bfloat16)
    return q, scales


@settings(max_examples=30, deadline=None)
@given(
    out=st.integers(1, 300),
    width=st.integers(2, 200),
    rows=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    extreme=st.sampled_from(["random", "all max", "alternating"]),
)
def test_fbgemm_gives_int_mms_logits_bit_for_bit(
    out: int, width: int, rows: int, seed: int, extreme: str
) -> None:
    q, scales = weight(out, width, seed)
    if extreme == "all max":
        q.fill_(127)
    elif extreme == "alternating":
        q[:, ::2], q[:, 1::2] = -127, 127
    packed = fbgemm_int8.prepack(q, scales)
    assert packed is not None, "the probe refused fbgemm on this host"
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed + 1)) * 3
    if extreme != "random":
        x[:, ::2] = x[:, ::2].abs()
        x[:, 1::2] = -x[:, 1::2].abs() if extreme == "alternating" else x[:, 1::2].abs()
    want = int8_dynamic_matmul(x, q, scales)
    got = int8_dynamic_matmul(x, q, scales, packed)
    assert torch.equal(got, want), (got - want).abs().max()
    for row in range(rows):  # the sentinels fix the scale whatever rows share the call
        alone = int8_dynamic_matmul(x[row : row + 1], q, scales, packed)
        assert torch.equal(alone[0], got[row])


def test_the_probe_refuses_sums_that_are_not_int_mms() -> None:
    """A packed weight that is not q (one level off in one place) fails the probe."""
    q, scales = weight(64, 48, seed=1)
    other = q.clone()
    other[5, 7] = 0 if int(other[5, 7]) != 0 else 1
    packed = fbgemm_int8.prepack(other, scales)
    assert packed is not None
    assert not fbgemm_int8._exact(packed, q, scales)
    assert fbgemm_int8._exact(fbgemm_int8.prepack(q, scales), q, scales)


def test_an_int8_head_takes_fbgemm_where_it_checks_out_and_int_mm_where_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(quantized_linear, "INT8_DYNAMIC_HEAD", True)
    table = torch.randn(500, 64, generator=torch.Generator().manual_seed(2))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    head = QuantizedLinear(table, "int8").as_head()
    assert head.fbgemm is not None
    fast = head(x)
    monkeypatch.setattr(fbgemm_int8, "_exact", lambda *args: False)
    refused = QuantizedLinear(table, "int8").as_head()
    assert refused.fbgemm is None
    assert torch.equal(refused(x), fast)
    assert QuantizedLinear(table, "int8").fbgemm is None, "only a head"


@pytest.mark.parametrize(("rows", "row", "bad"), [(1, 0, "nan"), (3, 0, "inf"), (3, 2, "nan")])
def test_a_row_with_a_nan_or_an_infinity_gets_int_mms_logits(rows: int, row: int, bad: str) -> None:
    """fbgemm's own range of the batch cannot take a NaN or an infinity (it raises, or turns a
    row of NaNs into infinities): such a step keeps `_int_mm`, whose bad row is NaN and whose
    other rows are untouched."""
    q, scales = weight(40, 24, seed=4)
    packed = fbgemm_int8.prepack(q, scales)
    x = torch.randn(rows, 24, generator=torch.Generator().manual_seed(5))
    x[row, 3] = float(bad)
    got = int8_dynamic_matmul(x, q, scales, packed)
    want = int8_dynamic_matmul(x, q, scales)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[row].isnan().all())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
