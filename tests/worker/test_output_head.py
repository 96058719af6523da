"""The output head as a QuantizedLinear (`as_head`): its logits are not rounded to bf16. The
largest HEAD_EXACT_TOP of a kernel call are x (float32) times their weight rows summed in
float32, so a near-tie that bf16 rounding would make a tie (and greedy decoding would break by
token id) keeps its order. Where its format's kernel is the faster at every row count
(`head_float32_rows`) the head keeps it at every row count, and a row's logits do not depend on
the rows beside it; elsewhere it takes the float32 path, unrounded, from HEAD_FLOAT32_ROWS rows.
The projections keep their bf16 roundings."""

from __future__ import annotations

import pytest
import torch

from worker.quantized_linear import (
    FLOAT32_ROWS,
    HEAD_EXACT_TOP,
    HEAD_FLOAT32_ROWS,
    KERNEL_ONLY,
    LinearFormat,
    QuantizedLinear,
    head_float32_rows,
)
from worker.tiny_model import TINY_CONFIG, tiny_model
from worker.weight_formats import apply_weight_format

VOCAB, HIDDEN = 512, 64


def table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5


def exact(head: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    return (x.double() @ head.reference_weight().double().t()).float()


@pytest.mark.parametrize(
    ("fmt", "column", "value"),
    [
        ("bf16", 1, 25.0 / 127),  # one int8 step of the row: held exactly by bf16 and int8
        ("int8", 1, 25.0 / 127),
        ("int4", 32, 1.0),  # alone in its group of 32 besides zeros: int4 holds it exactly
    ],
)
def test_a_near_tie_the_kernel_rounds_to_a_tie_keeps_its_order(
    fmt: LinearFormat, column: int, value: float
) -> None:
    """Two rows whose logits differ by less than a bf16 step: the kernel's bf16 output ties
    them, and its argmax is the lower id; the head's is the larger exact logit."""
    w = table(1) * 0.01
    w[7], w[300] = 0.0, 0.0
    w[7, 0] = w[300, 0] = 25.0
    w[300, column] = value
    x = torch.zeros(1, HIDDEN)
    x[0, 0], x[0, column] = 1.0, 0.004 / value  # logits 25.0 and 25.004: one bf16 value
    plain = QuantizedLinear(w, fmt)
    head = QuantizedLinear(w, fmt).as_head()
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
    for projections, head_rows in ((KERNEL_ONLY, KERNEL_ONLY), (8, turning), (64, turning)):
        monkeypatch.setitem(FLOAT32_ROWS, fmt, projections)
        assert head_float32_rows(fmt) == head_rows
        head = QuantizedLinear(table(2), fmt).as_head()
        assert head.float32_rows == head_rows


@pytest.mark.parametrize("rule", [HEAD_FLOAT32_ROWS, KERNEL_ONLY], ids=["turns", "kernel-only"])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_the_head_is_unrounded_where_it_counts_on_either_rule(fmt: LinearFormat, rule: int) -> None:
    """Both rules a CPU may get (`head_float32_rows`): the leaders exact below and past 32
    rows; every logit unrounded on the float32 path."""
    head = QuantizedLinear(table(2), fmt).as_head()
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
        else:  # the kernel: all but the recomputed top are its bf16 output
            unrounded = (got != got.to(torch.bfloat16).float()).sum(-1)
            assert int(unrounded.max()) <= HEAD_EXACT_TOP


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_a_kernel_only_heads_logits_of_a_row_do_not_depend_on_the_batch(
    fmt: LinearFormat,
) -> None:
    """With its kernel at every row count, a sequence decoding alone and the same sequence in
    a step of 40 get the same logits, bit for bit (on the float32 path from 32 rows they would
    not: the tail rounded alone, unrounded in the batch)."""
    head = QuantizedLinear(table(4), fmt).as_head()
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
