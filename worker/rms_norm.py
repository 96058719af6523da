"""RMSNorm whose sum of squares is a fixed tree of elementwise adds: the same bits from torch's
eager ops and from the code inductor generates for it, whatever rows are beside a row.

A reduction's rounding depends on the order it sums in, and that order is each implementation's
own: torch's `rms_norm` sums a row in the order its vectorized kernel takes, inductor's generated
code in another (71 of 300 random rows differed in the last bit; docs/worker.md, "The compiled
decode graphs"). Elementwise ops have no such freedom: an IEEE add, multiply, divide or square
root is correctly rounded, so `a + b` is the same bits wherever it runs. `rms_norm` therefore
writes the sum as a tree of adds of the row's halves (an odd width sets its last element aside,
added back at the end), each level one elementwise op over half the width of the last:

    576 -> 288 -> 144 -> 72 -> 36 -> 18 -> 9 (+ the 9th aside) -> 4 -> 2 -> 1

inductor keeps that tree (it does not reassociate float adds, and compiles without
floating-point contraction unless told to), so a compiled graph around the norms gives the eager
loop's bits (worker/decode_graph.py checks it on probe inputs before using one). A pairwise sum
is also closer to the exact one than a running sum. It is not Hugging Face's bits:
`LlamaRMSNorm` sums in torch's order, so a CPU model's norms differ from transformers' in the
last bit of some rows (tests/worker/test_decode_ops.py bounds it); the logits tests hold
transformers to 1e-4.

Eagerly it is about 20 ops where torch's fused `rms_norm` is one (60 us against 12 for one row,
4.0 against 3.3 ms for 2,048 rows, 2 threads): what a step pays where no compiled graph runs.
"""

from __future__ import annotations

import torch


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """x * x summed over the last dimension (kept, of size 1) as a tree of elementwise adds."""
    s, aside = x * x, None
    while (width := s.shape[-1]) > 1:
        half = width // 2
        if width % 2:
            last = s[..., 2 * half :]
            aside = last if aside is None else aside + last
        s = s[..., :half] + s[..., half : 2 * half]
    return s if aside is None else s + aside


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in x's dtype (float32 where
    it is used: the CPU's activations)."""
    normed = x * torch.rsqrt(sum_of_squares(x) / x.shape[-1] + eps)
    return normed if weight is None else normed * weight
