"""The output head as a QuantizedLinear (`as_head`): its logits are not rounded to bf16. The
largest HEAD_EXACT_TOP of a kernel call are x (float32) times their weight rows summed in
float32, so a near-tie that bf16 rounding would make a tie (and greedy decoding would break by
token id) keeps its order. Where its format's kernel is the faster at every row count
(`head_float32_rows`) the head keeps it at every row count, and a row's logits do not depend on
the rows beside it; elsewhere it takes the float32 path, unrounded, from HEAD_FLOAT32_ROWS rows.
The projections keep their bf16 roundings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker import quantized_linear
from worker.quantized_linear import (
    FLOAT32_ROWS,
    HEAD_EXACT_TOP,
    HEAD_FLOAT32_ROWS,
    KERNEL_ONLY,
    LinearFormat,
    QuantizedLinear,
    head_float32_rows,
    int8_dynamic_matmul,
)
from worker.tiny_model import TINY_CONFIG, tiny_model
from worker.weight_formats import apply_weight_format

VOCAB, HIDDEN = 512, 64


def table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5


def exact(head: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ head.reference_weight().double().t()).float()


HEADS = ["bf16", "int8", "int8-dynamic", "int4"]
"""Head kinds: each format's kernel, and the int8 head of a CPU with int8 dot products."""


def make_head(kind: str, weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> QuantizedLinear:
    """A head of `kind`, whichever CPU this is (int8 kinds: `INT8_DYNAMIC_HEAD` set as named)."""
    monkeypatch.setattr(quantized_linear, "INT8_DYNAMIC_HEAD", kind == "int8-dynamic")
    head = QuantizedLinear(weight, kind.removesuffix("-dynamic")).as_head()  # type: ignore[arg-type]
    assert head.dynamic_int8 == (kind == "int8-dynamic")
    return head


@pytest.mark.parametrize(
    ("kind", "column", "value"),
    [
        ("bf16", 1, 25.0 / 127),  # one int8 step of the row: held exactly by bf16 and int8
        ("int8", 1, 25.0 / 127),
        ("int8-dynamic", 1, 25.0 / 127),
        ("int4", 32, 1.0),  # alone in its group of 32 besides zeros: int4 holds it exactly
    ],
)
def test_a_near_tie_the_kernel_rounds_to_a_tie_keeps_its_order(
    kind: str, column: int, value: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rows whose logits differ by less than a bf16 step: the kernel's bf16 output ties
    them, and its argmax is the lower id; the head's is the larger exact logit."""
    w = table(1) * 0.01
    w[7], w[300] = 0.0, 0.0
    w[7, 0] = w[300, 0] = 25.0
    w[300, column] = value
    x = torch.zeros(1, HIDDEN)
    x[0, 0], x[0, column] = 1.0, 0.004 / value  # logits 25.0 and 25.004: one bf16 value
    fmt = kind.removesuffix("-dynamic")
    plain = QuantizedLinear(w, fmt)  # type: ignore[arg-type]
    head = make_head(kind, w, monkeypatch)
    want = exact(head, x)
    assert int(want.argmax()) == 300
    kernel = plain(x)
    assert kernel[0, 7] == kernel[0, 300], "the setup: bf16 rounding ties the two"
    got = head(x)
    assert got.dtype == torch.float32 and int(got.argmax()) == 300
    top = want.topk(HEAD_EXACT_TOP, dim=-1).indices
    torch.testing.assert_close(got.gather(1, top), want.gather(1, top), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_the_head_keeps_its_kernel_where_the_format_does_and_turns_at_32_elsewhere(
    fmt: LinearFormat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both CPUs' rules, whichever this one is: a format whose kernel is the faster at every
    row count (bf16 with AVX512-BF16, int4 with AVX-512 kernels) makes a kernel-only head; one
    that turns at some row count (8, 64) makes a head that turns at 32."""
    turning = HEAD_FLOAT32_ROWS
    monkeypatch.setattr(quantized_linear, "INT8_DYNAMIC_HEAD", False)
    for projections, head_rows in ((KERNEL_ONLY, KERNEL_ONLY), (8, turning), (64, turning)):
        monkeypatch.setitem(FLOAT32_ROWS, fmt, projections)
        assert head_float32_rows(fmt) == head_rows
        head = QuantizedLinear(table(2), fmt).as_head()
        assert head.float32_rows == head_rows


def test_an_int8_head_with_int8_dot_products_keeps_them_at_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the int8 projections' rule, the int8 head of a CPU with int8 dot products
    multiplies by `int8_dynamic_matmul` at every row count; on CUDA an int8 head keeps the
    Triton kernel (forced here onto the interpreter's path: not dynamic)."""
    monkeypatch.setitem(FLOAT32_ROWS, "int8", 64)
    head = make_head("int8-dynamic", table(2), monkeypatch)
    assert head.float32_rows == KERNEL_ONLY
    assert not QuantizedLinear(table(2), "int8", triton=True).as_head().dynamic_int8
    assert not QuantizedLinear(table(2), "int8").dynamic_int8, "only a head"


@pytest.mark.parametrize("rule", [HEAD_FLOAT32_ROWS, KERNEL_ONLY], ids=["turns", "kernel-only"])
@pytest.mark.parametrize("kind", HEADS)
def test_the_head_is_unrounded_where_it_counts_on_either_rule(
    kind: str, rule: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both rules a CPU may get (`head_float32_rows`): the leaders exact below and past 32
    rows; every logit unrounded on the float32 path. The dynamic int8 kernel's logits are
    float32 sums of exact integer sums, not bf16 values."""
    head = make_head(kind, table(2), monkeypatch)
    head.float32_rows = rule
    gen = torch.Generator().manual_seed(3)
    for rows in (1, HEAD_FLOAT32_ROWS - 1, HEAD_FLOAT32_ROWS, 40):
        x = torch.randn(rows, HIDDEN, generator=gen)
        got, want = head(x), exact(head, x)
        # the leaders are exact (the kernel's top HEAD_EXACT_TOP are; its ranking differs
        # from the exact one only near the edge)
        top = want.topk(8, dim=-1).indices
        torch.testing.assert_close(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if rows >= rule:  # the float32 path: every logit unrounded
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert not torch.equal(got, got.to(torch.bfloat16).float())
        elif head.dynamic_int8:  # float32, off by the activations' int8 rounding alone
            torch.testing.assert_close(got, want, rtol=0.0, atol=0.05)
            unrounded = (got != got.to(torch.bfloat16).float()).sum(-1)
            assert int(unrounded.min()) > HEAD_EXACT_TOP, "not the kernel's float32 sums"
        else:  # the kernel: all but the recomputed top are its bf16 output
            unrounded = (got != got.to(torch.bfloat16).float()).sum(-1)
            assert int(unrounded.max()) <= HEAD_EXACT_TOP


@pytest.mark.parametrize("kind", HEADS)
def test_a_kernel_only_heads_logits_of_a_row_do_not_depend_on_the_batch(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its kernel at every row count, a sequence decoding alone and the same sequence in
    a step of 40 get the same logits, bit for bit (on the float32 path from 32 rows they would
    not: the tail rounded alone, unrounded in the batch)."""
    head = make_head(kind, table(4), monkeypatch)
    head.float32_rows = KERNEL_ONLY
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(5))
    batch = head(x)
    for row in (0, 17, 39):
        assert torch.equal(head(x[row : row + 1])[0], batch[row])
    head.float32_rows = HEAD_FLOAT32_ROWS
    assert not torch.equal(head(x[:1])[0], head(x)[0])


def test_a_formatted_model_has_a_head_and_its_projections_are_not_heads() -> None:
    for fmt in ("bf16", "int8", "int4"):
        model = apply_weight_format(tiny_model(TINY_CONFIG), fmt)  # type: ignore[arg-type]
        assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.is_head
        layers = [m for m in model.model.modules() if isinstance(m, QuantizedLinear)]
        assert layers and not any(m.is_head or m.exact_top for m in layers)


def test_int8_dynamic_matmul_sums_exactly_what_each_row_rounds_to() -> None:
    """Each row of x is rounded to int8 steps of max|row| / 127 (half to even) and the products
    are summed exactly: the result is that rounded x times the weight, to float32's precision,
    within half a step per input of x times the weight; a zero row gives zeros; a row's result
    does not depend on the rows beside it."""
    gen = torch.Generator().manual_seed(6)
    weight = QuantizedLinear(table(5), "int8")
    q, scales = weight.q, weight.scales
    x = torch.randn(5, HIDDEN, generator=gen) * torch.tensor([[1.0], [10.0], [0.01], [3.0], [0.0]])
    got = int8_dynamic_matmul(x, q, scales)
    step = x.abs().amax(1, keepdim=True) / 127
    rounded = torch.round(x / step.clamp_min(1e-30)) * step
    w = q.double() * scales.double()[:, None]
    torch.testing.assert_close(got.double(), rounded.double() @ w.t(), rtol=1e-6, atol=1e-6)
    bound = (step.double() / 2) @ w.abs().sum(1, keepdim=True).t() + 1e-6
    assert ((got.double() - x.double() @ w.t()).abs() <= bound).all()
    assert torch.equal(got[4], torch.zeros(VOCAB))
    assert torch.equal(int8_dynamic_matmul(x[1:2], q, scales)[0], got[1])


def test_int8_dynamic_matmul_rounds_half_steps_to_even() -> None:
    """A row whose largest magnitude is 127 has steps of exactly 1: 0.5, 1.5, 2.5 and -0.5
    round to 0, 2, 2 and 0 (half to even), which a one-hot weight reads back column by column."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5]])
    one_hot = torch.eye(5, dtype=torch.int8)
    got = int8_dynamic_matmul(x, one_hot, torch.ones(5))
    assert got.tolist() == [[127.0, 0.0, 2.0, 2.0, 0.0]]


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads Linux's /proc/cpuinfo")
def test_int8_dot_products_are_detected_as_the_cpu_has_them() -> None:
    """INT8_DYNAMIC_HEAD agrees with the CPU's flags (AVX-512 VNNI, as Linux names it), so the
    dynamic head is not silently off on a CPU that has them, nor on where it would be slow."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    has = {"avx512f", "avx512_vnni"} <= flags and onednn
    assert has == quantized_linear.INT8_DYNAMIC_HEAD
