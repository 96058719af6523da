"""Which CPU path each weight format's linear layer should take: every candidate, timed.

Two SmolLM2-135M matrices, the output head (49,152 x 576) and an MLP projection (1,536 x 576),
times one token (decode) and 256 tokens (a prefill chunk), for each way this torch build can
multiply by a weight kept in that format:

    float32          F.linear, float32
    bf16             F.linear in bf16 (x cast to bf16, the product cast back)
    bf16 cvt f32     the bf16 weight cast to float32 every call, then the float32 matmul
    int4 kernel      aten._weight_int4pack_mm_for_cpu (bf16 x, group 32)
    int4 deq bf16    dequantize the groups to bf16 every call, then the bf16 matmul
    int4 deq f32     dequantize to float32 every call (from plain levels), float32 matmul
    int8 kernel      aten._weight_int8pack_mm (per-channel scales), bf16 x
    int8 kernel f32  the same with float32 x
    int8 cvt bf16    q.to(bf16), bf16 matmul, times the per-channel scales (gpt-fast's form)
    int8 cvt f32     q.float() times the scales every call, float32 matmul
    int8 deq bf16    grouped int8 (group 32) dequantized to bf16 every call, then the matmul

Each round times every candidate once, in turn (alternating, so a shared machine's drift hits
all alike); the table shows the median over rounds of the per-call mean. Random weights (the
speed of these kernels does not depend on the values). Run:
`python benchmarks/linear_formats_bench.py [--threads 2] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from worker.quantized_linear import pack_int4_cpu
from worker.quantized_weights import quantize

SHAPES = {"head 49152x576": (49152, 576), "mlp 1536x576": (1536, 576)}
Candidate = Callable[[torch.Tensor], torch.Tensor]


def _dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    offset: int,
    group: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    out, inp = q.shape
    w = (q.view(out, inp // group, group).to(dtype) - offset) * scales[..., None]
    return (w + zeros[..., None]).view(out, inp)


def candidates(out: int, inp: int, seed: int = 0) -> dict[str, Candidate]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) / inp**0.5
    w_bf16 = w.to(torch.bfloat16)
    q4 = quantize(w, "int4")
    packed = pack_int4_cpu(q4.q)
    s4, z4 = q4.scales.to(torch.bfloat16), q4.zeros.to(torch.bfloat16)
    scales_and_zeros = torch.stack([s4.t(), z4.t()], -1).contiguous()
    q8g = quantize(w, "int8")
    s8g = q8g.scales.to(torch.bfloat16)
    q8c = quantize(w, "int8", inp)  # per channel
    s8c, s8c_bf16 = q8c.scales.reshape(-1), q8c.scales.reshape(-1).to(torch.bfloat16)

    def bf16(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), w_bf16).float()

    def int4_kernel(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), packed, 32, scales_and_zeros
        )
        return y.float()

    def int4_deq(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), _dequantize(q4.q, s4, z4, 8, 32)).float()

    def int8_kernel(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q8c.q, s8c_bf16)
        return y.float()

    def int8_kernel_f32(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, q8c.q, s8c)

    def int8_cvt(x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x.to(torch.bfloat16), q8c.q.to(torch.bfloat16)) * s8c_bf16).float()

    def int8_deq(x: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros_like(s8g)
        return F.linear(x.to(torch.bfloat16), _dequantize(q8g.q, s8g, zero, 0, 32)).float()

    s4f, z4f = s4.float(), z4.float()

    def int4_deq_f32(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _dequantize(q4.q, s4f, z4f, 8, 32, torch.float32))

    def int8_cvt_f32(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, q8c.q.float() * s8c_bf16.float()[:, None])

    return {
        "float32": lambda x: F.linear(x, w),
        "bf16": bf16,
        "bf16 cvt f32": lambda x: F.linear(x, w_bf16.float()),
        "int4 kernel": int4_kernel,
        "int4 deq bf16": int4_deq,
        "int4 deq f32": int4_deq_f32,
        "int8 kernel": int8_kernel,
        "int8 kernel f32": int8_kernel_f32,
        "int8 cvt bf16": int8_cvt,
        "int8 cvt f32": int8_cvt_f32,
        "int8 deq bf16": int8_deq,
    }


def measure(rounds: int, budget_s: float) -> dict[str, dict[str, float]]:
    """{"<shape> x <tokens>": {candidate: median ms}}."""
    results: dict[str, dict[str, float]] = {}
    for shape, (out, inp) in SHAPES.items():
        fns = candidates(out, inp)
        for tokens in (1, 256):
            x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(1))
            reps = {}
            for name, fn in fns.items():  # warm up, and size each candidate's repeats
                start = time.perf_counter()
                fn(x)
                reps[name] = max(1, min(50, int(budget_s / max(time.perf_counter() - start, 1e-6))))
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    for _ in range(reps[name]):
                        fn(x)
                    times[name].append((time.perf_counter() - start) / reps[name] * 1e3)
            row = {name: statistics.median(t) for name, t in times.items()}
            results[f"{shape} x {tokens}"] = row
            print(
                f"{shape} x {tokens:>3} tokens: "
                + "  ".join(f"{name} {ms:.2f}" for name, ms in row.items())
                + "  (ms)",
                file=sys.stderr,
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per timing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = measure(args.rounds, args.budget)
    print(json.dumps({"threads": args.threads, "rounds": args.rounds, "ms": results}))


if __name__ == "__main__":
    main()
